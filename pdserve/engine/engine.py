"""The engine: one thread owns every request, the scheduler and the KV pool.

It is composed of a scheduler, a runner, the sampler and a role (engine/role.py), and its loop
is `drain inbox -> poll transfers -> expire -> admit -> schedule -> forward -> sample -> emit ->
send`, each a verb called by name (docs/architecture.md §Loop); forward, sample and emit are one
`Stepper.step` (engine/stepper.py: plain or overlapped). Other threads talk to it only
through the inbox (submit, abort, snapshot) and hear back through each request's sink; there
are no locks on request state. A request ends in one place, `finish`, with a reason from one
enum (`Event`). What its role wants changed, the role asks for as effects, which the engine
applies right after the role's verb returns (engine/role_host.py). A failure inside a step
fails only the requests it belongs to (engine/isolation.py, LESSONS #16); a command whose
handling raises fails its own request. With tensor parallelism (`cfg.tp` > 1) this engine is
rank 0 and leads the others (engine/tp_leader.py); their group failing fails every request and
ends the engine thread.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NoReturn

import torch

from pdserve.config import EngineConfig
from pdserve.engine import sizing
from pdserve.engine.commands import AbortCommand, Command, SnapshotQuery, SubmitCommand
from pdserve.engine.grammar_waits import GRAMMAR_POLL_S, GrammarWaits
from pdserve.engine.metrics import EngineMetrics
from pdserve.engine.pool_build import build_pool
from pdserve.engine.request import Event, OutputSink, Request
from pdserve.engine.role import Colocated, Role
from pdserve.engine.role_host import RoleHosting
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling.grammars import Grammars
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.snapshot import engine_snapshot, overdue
from pdserve.engine.stepper import Stepper
from pdserve.engine.tp_leader import TpLeader, build_leader
from pdserve.kvcache.host_pool import host_tier
from pdserve.kvcache.lease import Leases
from pdserve.kvcache.pool import KVPool
from pdserve.kvcache.prefix_cache import PrefixCache
from pdserve.kvcache.rank_pages import RankPages
from pdserve.model.loader import LoadedModel, load_model
from pdserve.model.tokenizer import Tokenizer
from pdserve.parallel.dp_tokens import DpTokens
from pdserve.parallel.lockstep import LockstepError
from pdserve.protocol.messages import Send
from pdserve.protocol.outputs import DEADLINE_ERROR
from pdserve.protocol.sampling import SamplingParams, validate_prompt
from pdserve.runtime.timing import OVERDUE_EVERY_S, OVERDUE_GRACE_S, ROLE_POLL_S, SYSTEM_CLOCK

log = logging.getLogger(__name__)


def _unsent(msg: Send) -> None:
    raise RuntimeError(f"this engine has no transport for {type(msg.msg).__name__}")


class Engine(RoleHosting):
    def __init__(
        self,
        cfg: EngineConfig,
        model: LoadedModel,
        pool: KVPool,
        eos_token_ids: frozenset[int],
        tp: TpLeader | None = None,
        pages: RankPages | None = None,
    ) -> None:
        """`tp`: the followers this engine leads, as rank 0 of `cfg.tp` (None at TP 1);
        `pages`: every rank's pool as the whole model's pages, for a PD role at TP > 1."""
        self.cfg = cfg
        self.tp = tp
        self.model = model
        self.pool = pool
        # What a PD role moves: whole pages (kvcache/rank_pages.py); None for TP > 1 co-located.
        self.pages = RankPages.of(pool) if tp is None else pages
        self.eos_token_ids = eos_token_ids
        self.vocab_size = model.arch.vocab_size
        self.max_model_len = min(
            cfg.scheduler.max_model_len, model.arch.max_position_embeddings, pool.capacity_tokens
        )
        # Every page taken from the pool is leased, and every state slot with it.
        self.leases = Leases(pool.allocator, pool.state)
        self.prefix_cache = (
            PrefixCache(self.leases, pool.page_size, host_tier(pool, cfg.cache.host_cache_bytes))
            if cfg.cache.prefix_cache
            else None
        )
        pins = lambda req: self.role.pins(req)  # the role is set later, by attach
        self.scheduler = Scheduler(
            cfg.scheduler, self.leases, pool.page_size, self.prefix_cache, pins
        )
        runner = cfg.runner
        eager = runner.enforce_eager or tp is not None  # no graph holds a rank's collectives yet
        self.runner = ModelRunner(
            model,
            pool,
            runner.attention_backend,
            cuda_graph_max_bs=0
            if eager
            else min(runner.cuda_graph_max_bs, cfg.scheduler.max_running),
            cuda_graph_max_tokens=0
            if eager
            else min(runner.cuda_graph_max_tokens, cfg.scheduler.max_batched_tokens),
            max_model_len=self.max_model_len,
            leader=tp,
            dp=DpTokens(tp.group) if tp is not None and cfg.dp_attention else None,
        )
        # Structured output: the vocabulary is read from the model's tokenizer on first use.
        self.grammars = Grammars(
            lambda: Tokenizer.from_dir(Path(cfg.model.path)), self.vocab_size, eos_token_ids
        )
        # Requests held while their grammar compiles (the loop never waits on a compile).
        self.grammar_waits = GrammarWaits(self.grammars)
        # The penalties' device state, and the grammars' masks.
        self.sampler = Sampler(cfg.scheduler.max_running, self.grammars)
        self.metrics = EngineMetrics()
        self.metrics.pages_total.set(pool.allocator.num_pages)  # every data-parallel rank's
        # Overlapped scheduling (engine/inflight.py): the stepper keeps the step in flight.
        # At TP > 1 off: a step's record carries every input id (parallel/step_record.py).
        overlap = runner.overlap_schedule
        self.overlap = pool.device.type == "cuda" if overlap is None else overlap
        self.overlap = self.overlap and tp is None
        self.stepper = Stepper(self)
        self._generated = 0  # tokens emitted since generated_tokens was last advanced
        self.role: Role = Colocated()
        self.transport: Callable[[Send], None] = _unsent  # where the role's messages go
        self.inbox: queue.Queue[Command | object] = queue.Queue()  # roles add their own
        # The loop's one source of time; its role gets `now` from it. Tests set a fake one.
        self.clock = SYSTEM_CLOCK
        self.last_tick = self.clock.monotonic()
        self.steps = 0
        # Requests and rooms still here past deadline + OVERDUE_GRACE_S, refreshed each tick
        # after the deadlines were applied: non-empty means a deadline did not end something
        # (a bug), and /health says so. Read by other threads; replaced, never mutated.
        self.overdue: tuple[str, ...] = ()
        self._overdue_at = 0.0  # when `overdue` was last computed
        self._meanwhile_ok = True  # the role's while_waiting did not raise this tick

    @classmethod
    def build(
        cls,
        cfg: EngineConfig,
        eos_token_ids: frozenset[int],
        shared_pool: bool = False,
        pd: bool = False,
    ) -> Engine:
        """Load the model, size and build the pool; at TP > 1 first start the followers and
        join their group (engine/tp_leader.py), then tell them the pool (`pd`: a PD role's,
        whose pages this rank reads and writes whole: every rank's in shared memory)."""
        if cfg.tp == 1:
            return cls._build(cfg, eos_token_ids, shared_pool, torch.device(cfg.model.device))
        return build_leader(
            cfg, lambda dev, tp: cls._build(cfg, eos_token_ids, shared_pool, dev, tp, pd)
        )

    @classmethod
    def _build(
        cls,
        cfg: EngineConfig,
        eos_token_ids: frozenset[int],
        shared_pool: bool,
        device: torch.device,
        tp: TpLeader | None = None,
        pd: bool = False,
    ) -> Engine:
        dtype = getattr(torch, cfg.model.dtype)
        group = None if tp is None else tp.group  # tensor parallel: this rank's shard
        model = load_model(Path(cfg.model.path), dtype, device, group, cfg.model.quantization)
        arch = model.arch
        if cfg.auto:  # the limits the user left to us, now that the weights are on the device
            cfg, chosen = sizing.resolve(cfg, arch, sizing.device_memory(device))
            log.info("limits: %s", chosen)
        pool, pages = build_pool(cfg, arch, device, shared_pool, tp, pd)
        return cls(cfg, model, pool, eos_token_ids, tp, pages)

    def attach(self, role: Role, transport: Callable[[Send], None]) -> None:
        """Before the loop starts: the role, and where the messages it returns are sent."""
        self.role = role
        self.transport = transport

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
        prefill: str | None = None,
    ) -> None:
        """Queue a request; `prefill`: the prefill worker that computes its prompt (decode role
        only), else this engine prefills it."""
        req = self.make_request(request_id, prompt_ids, params, sink, timeout_s)
        self.inbox.put(SubmitCommand(req, prefill))

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
        now = self.clock.monotonic()
        return Request(
            request_id,
            list(prompt_ids),
            params,
            sink,
            self.eos_token_ids,
            deadline=now + timeout,
            arrival=now,
        )

    def abort(self, request_id: str) -> None:
        self.inbox.put(AbortCommand(request_id))

    def snapshot(self, timeout_s: float = 2.0) -> dict[str, Any]:
        """The engine's own view, answered by the engine thread; raises TimeoutError if wedged."""
        fut: Future[dict[str, Any]] = Future()
        self.inbox.put(SnapshotQuery(fut))
        return fut.result(timeout=timeout_s)

    def on_control(self, inbound: Any) -> None:
        """On the control thread, before `inbound` is queued: the role may answer at once
        (the prefill role's Pong). Reads no engine state but `last_tick`."""
        reply = self.role.on_control(inbound, self.clock.monotonic())
        if reply is not None:
            self.transport(reply)

    # -- the engine thread ----------------------------------------------------------------
    def tick(self) -> None:
        """One loop iteration; the supervisor calls it forever."""
        self.last_tick = self.clock.monotonic()
        self._meanwhile_ok = True
        self._drain_inbox(self._wait_s())
        now = self.clock.monotonic()
        self._settle_grammars(now)
        self._role_verb(self.role.poll_transfers, now)
        self._role_verb(self.role.expire, now)
        self._expire_requests(now)
        self._role_verb(self.role.admit, now)
        self._send_outbox()  # replies go out before a step that may take seconds on a CPU
        if self.has_work():
            self.step()
            self._send_outbox()
        if self.tp is not None:
            try:
                self.tp.tick()  # a follower gone; an idle group hears from us (LESSONS #21)
            except LockstepError as e:
                self._ranks_lost(e)
        self._refresh_overdue()

    def while_waiting(self, in_step: Callable[[Request], bool]) -> None:
        """Mid-step, while the thread waits for the step on the device: the role's
        `while_waiting` (engine/role.py), and what it sent, sent. Its effects wait for the
        step's end. Should it raise, the step goes on (its tokens are not lost to it): the
        error is logged and counted as a step error, and the role is not asked again until the
        next tick."""
        if not self._meanwhile_ok:
            return
        try:
            self.role.while_waiting(self.clock.monotonic(), in_step)
            self._send_outbox()
        except Exception:  # noqa: BLE001 - the step's tokens must not be lost to it
            self._meanwhile_ok = False
            self.metrics.step_errors.inc()
            log.exception("the %s role's work during a step failed", self.role.name)

    def _role_verb(self, verb: Callable[[float], None], now: float) -> None:
        """Call one of the role's loop verbs, then apply what it asked, even if it raised: an
        effect left queued would wait past the next tick's commands (an abort would miss the
        request an Adopt was about to schedule)."""
        try:
            verb(now)
        finally:
            self.apply_effects(now)

    def sync(self) -> None:
        """Process the step in flight, if any: every sampled token is then on the host (tools
        and tests that plan a step themselves; the loop never needs it)."""
        self.stepper.complete()

    def has_work(self) -> bool:
        """Requests to step, or a step in flight whose outputs are not processed yet."""
        return self.scheduler.has_work() or self.stepper.in_flight

    def _wait_s(self) -> float:
        if self.has_work():
            return GRAMMAR_POLL_S if self._all_held() else 0.0
        if self.role.has_work():  # transfers to poll, rooms to time: short waits, no spinning
            return ROLE_POLL_S
        return self.cfg.idle_wait_s

    def _all_held(self) -> bool:
        """Every request the scheduler has is held for its grammar, and no step is in flight:
        the loop waits a little for the compile (or a command) instead of spinning."""
        held = len(self.grammar_waits)
        s = self.scheduler
        return held > 0 and not self.stepper.in_flight and held >= len(s.waiting) + len(s.running)

    def _settle_grammars(self, now: float) -> None:
        """Held requests whose grammar is done go on, or fail alone (engine/grammar_waits.py)."""
        for held, why in self.grammar_waits.settle():
            req, c = held.req, held.req.params.constraint
            if why is not None:  # the role's first (P tells D), as any failure of its own
                kind = c.kind.value if c is not None else "?"
                self.stepper.fail(req, f"the {kind} constraint {why}")
            elif held.first is not None:
                tok, lp, at = held.first
                self._take_first_token(req, tok, lp, at)

    def _send_outbox(self) -> None:
        for msg in self.role.take_outbox():
            self.transport(msg)

    def _drain_inbox(self, wait_s: float) -> None:
        """Handle every queued command, first waiting up to `wait_s` for one (any wakes us).
        What the role asked and is not applied yet (a failure last tick left it queued) is
        applied first, so no command sees the engine without it."""
        self.apply_effects(self.clock.monotonic())
        try:
            cmd = self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            now = self.clock.monotonic()  # fresh per command: a long drain must not age it
            try:
                self._handle(cmd, now)
            except Exception as e:  # noqa: BLE001 - input must not kill this thread (LESSONS #1)
                self._command_failed(cmd, e, now)
            self.apply_effects(now)
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _command_failed(self, cmd: Command | object, e: Exception, now: float) -> None:
        """A command whose handling raised ends its own request or room, and only that one;
        the supervisor's restart budget is for bugs in the loop, not for bad input."""
        self.metrics.command_errors.inc()
        log.warning("engine command %s failed: %s: %s", type(cmd).__name__, type(e).__name__, e)
        why = f"could not handle the request: {type(e).__name__}: {e}"
        self.apply_effects(now)  # what the role asked before it raised, first
        self.role.command_failed(cmd, why, now)
        self.apply_effects(now)
        if isinstance(cmd, SubmitCommand):
            self.finish(cmd.request, Event.FAIL, why)

    def _handle(self, cmd: Command | object, now: float) -> None:
        match cmd:
            case SubmitCommand(request=req, prefill=None):
                if self.scheduler.get(req.request_id) is not None:
                    self.finish(req, Event.FAIL, f"duplicate request id {req.request_id}")
                    return
                self.scheduler.add(req)
                self.grammar_waits.hold(req)
                self.metrics.prompt_tokens.inc(len(req.prompt_ids))  # once it is scheduled
                self.role.local_prefill(req, now)
            case AbortCommand(request_id=rid):
                if self.role.abort(rid, now):
                    return
                live = self.scheduler.get(rid)
                if live is not None:  # unknown or already finished: nothing to do
                    self.finish(live, Event.ABORT)
            case SubmitCommand(request=req):  # a prefill address: the role's (D opens a room)
                if req.params.constraint is not None:
                    self.grammars.poll(req.params.constraint)  # it compiles during P's prefill
                self.role.handle(cmd, now)
                self.metrics.prompt_tokens.inc(len(req.prompt_ids))
            case SnapshotQuery(reply=fut):
                if not fut.done():
                    fut.set_result(self._snapshot())
            case _:  # a peer's message, a failed send: the role's
                self.role.handle(cmd, now)

    def _expire_requests(self, now: float) -> None:
        for req in list(self.scheduler.waiting) + list(self.scheduler.running):
            if req.deadline is not None and now > req.deadline:
                self.finish(req, Event.FAIL, f"{DEADLINE_ERROR} in state {req.status.value}")

    def _refresh_overdue(self) -> None:
        now = self.clock.monotonic()
        if now - self._overdue_at < OVERDUE_EVERY_S:
            return  # the loop may tick every 0.5 ms; health needs this a few times a second
        self._overdue_at = now
        reqs = list(self.scheduler.waiting) + list(self.scheduler.running)
        self.overdue = overdue(now - OVERDUE_GRACE_S, now, reqs, self.role.rooms())

    def step(self) -> None:
        """Schedule, launch, and emit the tokens of the step before (overlapped) or of this
        one (plain): engine/stepper.py. Then the step's metrics."""
        try:
            plan = self.stepper.step()
        except LockstepError as e:
            self._ranks_lost(e)
        self.steps += 1
        generated, self._generated = self._generated, 0  # emit_token's, D's first tokens too
        cache = self.prefix_cache.stats if self.prefix_cache is not None else None
        self.metrics.after_step(len(plan.preempted), generated, self.scheduler.counts(), cache)

    def _ranks_lost(self, e: LockstepError) -> NoReturn:
        """The tensor-parallel group failed: every request fails, the thread dies for good."""
        assert self.tp is not None  # only a leader's runner raises LockstepError
        live = list(self.scheduler.waiting) + list(self.scheduler.running)
        self.tp.ranks_lost(e, live, lambda req, why: self.finish(req, Event.FAIL, why))

    def _snapshot(self) -> dict[str, Any]:
        return engine_snapshot(
            self.role.snapshot(self.clock.monotonic()),
            self.steps,
            self.max_model_len,
            self.pool,
            self.leases,
            list(self.scheduler.running) + list(self.scheduler.waiting),
            self.prefix_cache,
        )
