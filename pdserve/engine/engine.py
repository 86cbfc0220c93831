"""The engine: one thread owns every request, the scheduler and the KV pool.

Its loop is `drain inbox -> apply deadlines -> schedule -> forward -> sample -> emit`.
Other threads talk to it only through the inbox (submit, abort, snapshot) and hear back
through each request's sink; there are no locks on request state. A failure inside a step
fails only the requests it belongs to (engine/isolation.py): the forward is run again chunk
by chunk, or the rows are sampled one by one, and the rest of the batch goes on with the
tokens it would have had (LESSONS #16). A command whose handling raises fails its own request.
"""

from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.config import EngineConfig
from pdserve.engine.isolation import forward_each, sample_rows
from pdserve.engine.metrics import EngineMetrics
from pdserve.engine.params import SamplingParams, validate_prompt
from pdserve.engine.request import (
    FINISH_REASON,
    Event,
    OutputSink,
    Request,
    RequestOutput,
    TokenLogprob,
)
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import sample
from pdserve.engine.scheduler import Scheduler, StepPlan
from pdserve.engine.snapshot import engine_snapshot
from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.lease import Leases
from pdserve.kvcache.pool import KVPool, pages_for_budget
from pdserve.model.llama import CausalLM
from pdserve.model.loader import load_model
from pdserve.protocol.outputs import DEADLINE_ERROR

log = logging.getLogger(__name__)

# With no batch to run but transfers in flight or rooms waiting on a peer, the loop wakes this
# often to poll them (an inbox command wakes it at once). Spinning instead would take a core
# from the peer or the transfer's progress thread on a small machine.
ROLE_POLL_S = 0.0005
ENGINE_HEARTBEAT_S = 30.0  # the engine thread's heartbeat bound: a CPU step can take seconds
OVERDUE_GRACE_S = 1.0
OVERDUE_EVERY_S = 0.25


@dataclass(frozen=True)
class Submit:
    request: Request


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class SnapshotQuery:
    reply: Future[dict[str, Any]]


Command = Submit | Abort | SnapshotQuery


class Engine:
    def __init__(
        self, cfg: EngineConfig, model: CausalLM, pool: KVPool, eos_token_ids: frozenset[int]
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.pool = pool
        self.eos_token_ids = eos_token_ids
        self.vocab_size = model.arch.vocab_size
        self.max_model_len = min(
            cfg.scheduler.max_model_len, model.arch.max_position_embeddings, pool.capacity_tokens
        )
        self.leases = Leases(pool.allocator)  # every page taken from the pool is leased
        self.scheduler = Scheduler(cfg.scheduler, self.leases, pool.page_size)
        self.runner = ModelRunner(model, pool)
        self.metrics = EngineMetrics()
        self.metrics.pages_total.set(pool.num_pages)
        self.inbox: queue.Queue[Command | object] = queue.Queue()  # roles add their own
        self.last_tick = time.monotonic()
        self.steps = 0
        # Requests and rooms still here past deadline + OVERDUE_GRACE_S, refreshed each tick
        # after the deadlines were applied: non-empty means a deadline did not end something
        # (a bug), and /health says so. Read by other threads; replaced, never mutated.
        self.overdue: tuple[str, ...] = ()
        self._overdue_at = 0.0  # when `overdue` was last computed

    @classmethod
    def build(
        cls, cfg: EngineConfig, eos_token_ids: frozenset[int], shared_pool: bool = False
    ) -> Engine:
        device = torch.device(cfg.model.device)
        dtype = getattr(torch, cfg.model.dtype)
        model = load_model(Path(cfg.model.path), dtype, device)
        arch = model.arch
        layout = KVLayout.llama(
            dtype=cfg.model.dtype,
            page_size=cfg.cache.page_size,
            num_layers=arch.num_layers,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
        )
        num_pages = pages_for_budget(layout, cfg.cache.kv_budget_bytes)
        pool = KVPool(layout, num_pages, device, shared=shared_pool)
        log.info(
            "KV pool: %d pages x %d tokens = %d tokens (%.1f MiB)",
            num_pages,
            layout.page_size,
            pool.capacity_tokens,
            pool.data.numel() / 2**20,
        )
        return cls(cfg, model, pool, eos_token_ids)

    # -- called from other threads --------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidParams for a request this engine can never serve (the router's rules)."""
        validate_prompt(prompt_ids, params, self.vocab_size, self.max_model_len)

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: OutputSink,
        timeout_s: float | None = None,
    ) -> None:
        self.inbox.put(Submit(self.make_request(request_id, prompt_ids, params, sink, timeout_s)))

    def make_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: OutputSink,
        timeout_s: float | None,
    ) -> Request:
        """A validated request whose deadline is capped by the engine's request timeout."""
        self.validate(prompt_ids, params)
        timeout = min(timeout_s or self.cfg.request_timeout_s, self.cfg.request_timeout_s)
        return Request(
            request_id,
            list(prompt_ids),
            params,
            sink,
            self.eos_token_ids,
            deadline=time.monotonic() + timeout,
        )

    def abort(self, request_id: str) -> None:
        self.inbox.put(Abort(request_id))

    def snapshot(self, timeout_s: float = 2.0) -> dict[str, Any]:
        """The engine's own view, answered by the engine thread; raises TimeoutError if wedged."""
        fut: Future[dict[str, Any]] = Future()
        self.inbox.put(SnapshotQuery(fut))
        return fut.result(timeout=timeout_s)

    # -- the engine thread ----------------------------------------------------------------
    def tick(self) -> None:
        """One loop iteration; the supervisor calls it forever."""
        self.last_tick = time.monotonic()
        if self.scheduler.has_work():
            wait = 0.0
        elif self.has_role_work():  # transfers to poll, rooms to time: short waits, no spinning
            wait = ROLE_POLL_S
        else:
            wait = self.cfg.idle_wait_s
        self._drain_inbox(wait)
        self._apply_deadlines()
        if self.scheduler.has_work():
            self.step()

    def _drain_inbox(self, wait_s: float) -> None:
        """Handle every queued command, first waiting up to `wait_s` for one (any wakes us)."""
        try:
            cmd = self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                self._handle(cmd)
            except Exception as e:  # noqa: BLE001 - input must not kill this thread (LESSONS #1)
                self._command_failed(cmd, e)
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _command_failed(self, cmd: Command | object, e: Exception) -> None:
        """A command whose handling raised ends its own request or room, and only that one;
        the supervisor's restart budget is for bugs in the loop, not for bad input."""
        self.metrics.command_errors.inc()
        log.warning("engine command %s failed: %s: %s", type(cmd).__name__, type(e).__name__, e)
        why = f"could not handle the request: {type(e).__name__}: {e}"
        if isinstance(cmd, Submit):
            req = cmd.request
            if self.scheduler.get(req.request_id) is req:
                req.error = why
                self._finish(req, Event.FAIL)
            elif not req.status.finished:
                self._emit_end(req, "error", why)
            return
        self.command_failed(cmd, why)

    def command_failed(self, cmd: object, why: str) -> None:
        """Role engines: end whatever request or room `cmd` concerned (see _command_failed)."""

    def _handle(self, cmd: Command | object) -> None:
        match cmd:
            case Submit(request=req):
                if self.scheduler.get(req.request_id) is not None:
                    self._emit_end(req, "error", f"duplicate request id {req.request_id}")
                    return
                self.metrics.prompt_tokens.inc(len(req.prompt_ids))
                self.scheduler.add(req)
            case Abort(request_id=rid):
                if self.abort_role(rid):
                    return
                live = self.scheduler.get(rid)
                if live is not None:  # unknown or already finished: nothing to do
                    self._finish(live, Event.ABORT)
            case SnapshotQuery(reply=fut):
                if not fut.done():
                    fut.set_result(self._snapshot())
            case _:
                self.handle_other(cmd)

    def handle_other(self, cmd: object) -> None:
        """Role engines (prefill, decode) handle their own inbox commands here."""
        raise TypeError(f"engine inbox: unexpected command {type(cmd).__name__}")

    def _apply_deadlines(self) -> None:
        self.apply_role_deadlines()
        now = time.monotonic()
        for req in list(self.scheduler.waiting) + list(self.scheduler.running):
            if req.deadline is not None and now > req.deadline:
                req.error = f"{DEADLINE_ERROR} in state {req.status.value}"
                self._finish(req, Event.FAIL)
        if now - self._overdue_at < OVERDUE_EVERY_S:
            return  # the loop may tick every 0.5 ms; health needs this a few times a second
        self._overdue_at = now
        late = now - OVERDUE_GRACE_S
        reqs = list(self.scheduler.waiting) + list(self.scheduler.running)
        self.overdue = tuple(
            [
                f"request {r.request_id} ({r.status.value}) {now - r.deadline:.1f}s past deadline"
                for r in reqs
                if r.deadline is not None and r.deadline < late
            ]
            + [
                f"room {room.room} ({room.state.value}) {now - room.deadline:.1f}s past deadline"
                for room in self.role_rooms()
                if room.deadline < late
            ]
        )

    def step(self) -> None:
        plan = self.scheduler.schedule()
        self.metrics.preemptions.inc(len(plan.preempted))
        if plan.chunks:
            try:
                self._run(plan)
            except Exception as e:  # noqa: BLE001 - a bug past the isolation: fail the step
                self.metrics.step_errors.inc()
                log.exception("engine step failed; failing %d requests", len(plan.chunks))
                for c in plan.chunks:
                    self._fail_in_step(c.request, f"engine step failed: {type(e).__name__}: {e}")
        self.steps += 1
        counts = self.scheduler.counts()
        self.metrics.running.set(counts["running"])
        self.metrics.waiting.set(counts["waiting"])
        self.metrics.pages_used.set(counts["pages_used"])

    def abort_role(self, request_id: str) -> bool:
        """Role engines abort requests they hold outside the scheduler; True if handled."""
        return False

    def apply_role_deadlines(self) -> None:
        """Role engines enforce the deadlines of their transfer rooms here."""

    def role_rooms(self) -> list[Any]:
        """Role engines: their open transfer rooms (each with .room, .state, .deadline)."""
        return []

    def has_role_work(self) -> bool:
        return False

    def role_snapshot(self) -> dict[str, Any]:
        return {}

    def on_control(self, inbound: Any) -> None:
        """Role engines: each inbound message, on the control thread, before it is queued."""

    def _run(self, plan: StepPlan) -> None:
        chunks = list(plan.chunks)
        try:
            logits = self.runner.forward(chunks)
        except Exception as e:  # noqa: BLE001 - find the chunk at fault, run the others
            self.metrics.step_errors.inc()
            log.warning(
                "forward failed (%s: %s); running its chunks one by one", type(e).__name__, e
            )
            logits, chunks = forward_each(self.runner, chunks, self._fail_in_step)
        for c in chunks:
            c.request.num_computed = c.start + c.length
        self.on_computed(plan)
        sampling = [c.request for c in chunks if c.samples]
        if not sampling:
            return
        picked, split = sample_rows(sample, logits, sampling, self._fail_in_step)
        if split:
            self.metrics.step_errors.inc()
        for req, tok, lp in picked:
            try:
                self.on_token(req, tok, lp)
            except Exception as e:  # noqa: BLE001 - a bug handling one token costs its request
                log.exception("handling a token of %s failed", req.request_id)
                self._fail_in_step(req, f"handling its token failed: {type(e).__name__}: {e}")

    def _fail_in_step(self, req: Request, why: str) -> None:
        if not req.status.finished:
            self.fail_request(req, why)

    def fail_request(self, req: Request, why: str) -> None:
        """End a scheduled request with an error (the prefill role fails its room instead)."""
        req.error = why
        self._finish(req, Event.FAIL)

    def on_computed(self, plan: StepPlan) -> None:
        """After a forward: the chunks' KV is in the pool (the prefill role ships it)."""

    def on_token(self, req: Request, tok: int, lp: TokenLogprob | None) -> None:
        """A token was sampled for `req`: record it, stream it, stop if it ends the request."""
        now = time.monotonic()
        req.output_ids.append(tok)
        self.metrics.generated_tokens.inc()
        if req.first_token_at is None:
            req.first_token_at = now
            self.metrics.ttft.observe(now - req.arrival)
        elif req.last_token_at is not None:
            self.metrics.itl.observe(now - req.last_token_at)
        req.last_token_at = now
        event = self._stop_event(req, tok)
        if event is not None:  # the last token carries the finish reason, as in vLLM
            self._finish(req, event, last=(tok, lp))
            return
        req.sink(
            RequestOutput(
                req.request_id,
                (tok,),
                (lp,) if lp is not None else (),
                num_prompt_tokens=len(req.prompt_ids),
            )
        )

    def _stop_event(self, req: Request, tok: int) -> Event | None:
        p = req.params
        if len(req.output_ids) >= p.min_tokens and (
            tok in p.stop_token_ids or (not p.ignore_eos and tok in req.eos_token_ids)
        ):
            return Event.STOP
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return Event.LENGTH
        return None

    def _finish(
        self, req: Request, event: Event, last: tuple[int, TokenLogprob | None] | None = None
    ) -> None:
        """End `req` and tell its sink once; `last` is a final token to deliver with the end."""
        self.scheduler.finish(req, event)
        reason = FINISH_REASON[req.status]
        self.metrics.finished.labels(reason).inc()
        self.metrics.e2e.observe(time.monotonic() - req.arrival)
        if last is None:
            self._emit_end(req, reason, req.error)
            return
        tok, lp = last
        req.sink(
            RequestOutput(
                req.request_id,
                (tok,),
                (lp,) if lp is not None else (),
                reason,
                req.error,
                len(req.prompt_ids),
            )
        )

    def _emit_end(self, req: Request, reason: str, error: str | None) -> None:
        req.sink(RequestOutput(req.request_id, (), (), reason, error, len(req.prompt_ids)))

    def _snapshot(self) -> dict[str, Any]:
        return engine_snapshot(
            self.role_snapshot(),
            self.steps,
            self.max_model_len,
            self.pool,
            self.leases,
            list(self.scheduler.running) + list(self.scheduler.waiting),
        )
