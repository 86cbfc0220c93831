"""Health of the fleet: a liveness loop over every worker, and the deep canary.

* Liveness: every `health_interval_s`, each worker's GET /health, concurrently, each bounded
  by `health_timeout_s`. A failure takes the worker out of rotation; a pass brings it back.
* Deep: a real one-token greedy request through every (P, D) pair — (None, D) for
  co-located workers — the way client requests go (on D's output channel, when the router
  uses them), concurrently, each bounded by `deep_timeout_s`. A failing pair
  leaves rotation; the loop re-probes failed pairs every `pair_retry_s` so that a pair
  comes back once it passes, even if nobody calls /health/deep again.
* At most one round of canaries is in flight (single flight): /health/deep answers from the
  last full round while it is younger than DEEP_FRESH_S, else joins the round in flight or
  starts one; every caller gets the answer with its age (`age_s`), so a flood of callers costs
  at most one canary per pair every DEEP_FRESH_S. A canary is a generation: its round takes
  one `--max-queue` slot per pair (server/admission.py) and is not run when they are taken;
  the caller then gets the last result, however old, saying why. A change of rotation since
  the last round (a worker down or back, a pair failed or passed) makes it stale at once.
* A canary that timed out on a pair through which a client request succeeded meanwhile says
  "busy", not "fail": the cluster is loaded, not broken, and the pair stays in rotation. A
  canary that errs, or times out while nothing gets through the pair, fails it.
The loop survives its own bugs (logged, counted, next round) and beats a heartbeat, which
the router's /health reports on: a router whose health loop stopped is not healthy.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pdserve.protocol.generate import Generate
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams
from pdserve.router.backend import generate_body
from pdserve.router.client import WorkerClient, WorkerError
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import PairKey, Registry, Route
from pdserve.server.admission import Admission

log = logging.getLogger(__name__)

CANARY_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
RunOnce = Callable[[Route, Generate, float], Awaitable[list[RequestOutput]]]
DEEP_FRESH_S = 1.0  # a full round this recent answers /health/deep without a new one
ROUND_GRACE_S = 2.0  # past a round's own bound (every probe is bounded by deep_timeout_s)


@dataclass(frozen=True)
class DeepAnswer:
    """What /health/deep says: the pairs of the last full round (None: there never was one),
    its age, and why it is not fresh when it could not be (`stale`)."""

    pairs: list[dict[str, Any]] | None
    age_s: float | None
    stale: str | None = None

    @property
    def ok(self) -> bool:
        return self.pairs is not None and all(p["ok"] for p in self.pairs)

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ok": self.ok,
            "pairs": self.pairs or [],
            "age_s": None if self.age_s is None else round(self.age_s, 3),
        }
        if self.stale is not None:
            out["stale"] = self.stale
        return out


@dataclass(frozen=True)
class _Round:
    pairs: list[dict[str, Any]]
    finished_at: float  # monotonic
    changes: int  # Registry.changes then: a worker or pair that changed since makes it stale


class HealthMonitor:
    def __init__(
        self,
        cfg: RouterConfig,
        registry: Registry,
        clients: dict[str, WorkerClient],
        metrics: RouterMetrics,
        canary_prompt: list[int],
        run_once: RunOnce,
        admission: Admission | None = None,
    ) -> None:
        """`run_once(route, body, timeout_s)`: one request's outputs, the way the clients'
        requests go (RemoteBackend.run_once), WorkerError if it fails. `admission`: the
        front end's `--max-queue` bound, which canaries count against (None: unbounded)."""
        if not canary_prompt:
            raise ValueError("the deep-health canary needs a non-empty prompt")
        self.cfg = cfg
        self.registry = registry
        self.clients = clients
        self.metrics = metrics
        self.canary_prompt = canary_prompt
        self.run_once = run_once
        self.admission = admission
        self.last_beat = time.monotonic()
        self.loop_errors = 0
        self._round: asyncio.Task[list[dict[str, Any]]] | None = None  # the one in flight
        self._last: _Round | None = None  # the last full round
        self.rounds = 0  # rounds started (for tests and /debug)
        self.skipped = 0  # rounds not started: no --max-queue slots

    def stale_for(self) -> float:
        return time.monotonic() - self.last_beat

    @property
    def max_round_s(self) -> float:
        """The longest one loop round may take: the router's /health allows this much."""
        return self.cfg.health_interval_s + self.cfg.health_timeout_s + self.cfg.deep_timeout_s

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.last_beat = time.monotonic()
            try:
                await self.check_liveness()
                retry = self.registry.pairs_to_retry(time.monotonic(), self.cfg.pair_retry_s)
                if retry:
                    await self.deep(retry)
                self.metrics.publish(self.registry)  # the other processes' scrapes read it
            except Exception:  # noqa: BLE001 - a bug in one round must not end the loop
                self.loop_errors += 1
                log.exception(
                    "health loop round failed (%d so far); next round goes on", self.loop_errors
                )
            try:
                async with asyncio.timeout(self.cfg.health_interval_s):
                    await stop.wait()
            except TimeoutError:
                pass  # the next round is due
        if self._round is not None:
            self._round.cancel()  # stopping: a canary left on D ends at its own deadline

    async def check_liveness(self) -> None:
        await asyncio.gather(*(self._check(w.url) for w in self.registry.workers))

    async def _check(self, url: str) -> None:
        error: str | None = None
        try:
            await self.clients[url].health(self.cfg.health_timeout_s)
        except WorkerError as e:
            error = e.what
        note = self.registry.mark_worker(url, error is None, error, time.monotonic())
        if note:
            log.warning("%s", note)

    async def deep(self, keys: list[PairKey] | None = None) -> list[dict[str, Any]]:
        """Probe the given pairs (default: all) concurrently, one result dict per pair; if a
        round is in flight, its results instead (it re-probed them, or is about to say more);
        [] when --max-queue has no slots for a round."""
        task = self._joined(keys)
        return [] if task is None else await self._wait(task)

    async def answer(self) -> DeepAnswer:
        """/health/deep's answer: the last full round if fresh, else a new one, shared by
        every caller meanwhile (see the module docstring)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2 * (self.cfg.deep_timeout_s + ROUND_GRACE_S)
        while True:
            last = self._last
            age = None if last is None else time.monotonic() - last.finished_at
            if (
                last is not None
                and age is not None
                and age < DEEP_FRESH_S
                and last.changes == self.registry.changes
            ):
                return DeepAnswer(last.pairs, age)
            task = self._joined(None)
            if task is None:
                why = "the router's --max-queue is full: no canary was run"
                return DeepAnswer(last.pairs if last else None, age, why)
            try:
                async with asyncio.timeout_at(deadline):
                    await self._wait(task)
            except TimeoutError:
                why = "no canary round finished in time"  # a round a partial one held up
                return DeepAnswer(last.pairs if last else None, age, why)

    def _joined(self, keys: list[PairKey] | None) -> asyncio.Task[list[dict[str, Any]]] | None:
        """The round in flight, or else a new one of `keys` (None: every pair, and it becomes
        `_last`); None when the --max-queue bound has no slot per pair for a new one."""
        if self._round is not None and not self._round.done():
            return self._round
        chosen = self.registry.pair_keys() if keys is None else keys
        if self.admission is not None and not self.admission.reserve(len(chosen)):
            self.skipped += 1
            return None
        self.rounds += 1
        coro = self._run_round(chosen, full=keys is None)
        self._round = asyncio.get_running_loop().create_task(coro)
        return self._round

    async def _run_round(self, keys: list[PairKey], full: bool) -> list[dict[str, Any]]:
        try:
            pairs = list(await asyncio.gather(*(self.probe(k) for k in keys)))
        finally:
            if self.admission is not None:
                self.admission.release(len(keys))
        if full:
            self._last = _Round(pairs, time.monotonic(), self.registry.changes)
        return pairs

    async def _wait(self, task: asyncio.Task[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """The round's results; shielded, so a caller that leaves does not cancel it for the
        others, and bounded (every probe is bounded by deep_timeout_s itself)."""
        bound = self.cfg.deep_timeout_s + ROUND_GRACE_S
        async with asyncio.timeout(bound):
            return await asyncio.shield(task)

    async def probe(self, key: PairKey) -> dict[str, Any]:
        p_url, d_url = key
        route = Route(self.registry.worker(d_url), self.registry.worker(p_url) if p_url else None)
        rid = f"deep-health-{uuid.uuid4().hex[:12]}"
        timeout = self.cfg.deep_timeout_s
        body = generate_body(rid, self.canary_prompt, CANARY_PARAMS, timeout, route)
        t0 = time.monotonic()
        error: str | None = None
        tokens = 0
        try:
            # Bounded, connect to last line, by `timeout`; the way client requests go.
            for out in await self.run_once(route, body, timeout):
                tokens += len(out.token_ids)
                if out.finish_reason is not None and out.finish_reason != "length":
                    error = f"finished with {out.finish_reason!r}: {out.error}"
            if error is None and tokens != 1:
                error = f"generated {tokens} tokens, expected exactly 1"
        except WorkerError as e:
            error = e.what  # run_once has aborted it on D if D may still run it
        latency = time.monotonic() - t0
        status = "pass" if error is None else "fail"
        if error is not None:
            error = f"{route.describe()}: {error}"
            # Only a timeout can be load: run_once raises at its deadline, not before.
            if latency >= timeout and self.registry.serving_since(key, t0):
                status = "busy"
                error += "; client requests through the pair succeeded meanwhile: kept"
                log.info("deep health canary slow on a loaded pair: %s", error)
        if status != "busy":  # a busy pair keeps whatever state it had
            note = self.registry.mark_pair(key, status == "pass", latency, error, time.monotonic())
            if note:
                log.warning("%s", note)
            self.metrics.deep_result(key, status == "pass", latency)
        return {
            "prefill": p_url,
            "decode": d_url,
            "ok": status != "fail",
            "status": status,
            "latency_ms": round(latency * 1e3, 1),
            "error": error,
        }
