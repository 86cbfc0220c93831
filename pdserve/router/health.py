"""Health of the fleet: a liveness loop over every worker, and the deep canary.

* Liveness: every `health_interval_s`, each worker's GET /health, concurrently, each bounded
  by `health_timeout_s`. A failure takes the worker out of rotation; a pass brings it back.
* Deep: a real one-token greedy request through every (P, D) pair — (None, D) for
  co-located workers — the way client requests go (on D's output channel, when the router
  uses them), concurrently, each bounded by `deep_timeout_s`. A failing pair
  leaves rotation; the loop re-probes failed pairs every `pair_retry_s` so that a pair
  comes back once it passes, even if nobody calls /health/deep again.
The loop survives its own bugs (logged, counted, next round) and beats a heartbeat, which
the router's /health reports on: a router whose health loop stopped is not healthy.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams
from pdserve.router.backend import generate_body
from pdserve.router.client import WorkerClient, WorkerError
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import PairKey, Registry, Route

log = logging.getLogger(__name__)

CANARY_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
RunOnce = Callable[[Route, dict[str, Any], float], Awaitable[list[RequestOutput]]]


class HealthMonitor:
    def __init__(
        self,
        cfg: RouterConfig,
        registry: Registry,
        clients: dict[str, WorkerClient],
        metrics: RouterMetrics,
        canary_prompt: list[int],
        run_once: RunOnce,
    ) -> None:
        """`run_once(route, body, timeout_s)`: one request's outputs, the way the clients'
        requests go (RemoteBackend.run_once), WorkerError if it fails."""
        if not canary_prompt:
            raise ValueError("the deep-health canary needs a non-empty prompt")
        self.cfg = cfg
        self.registry = registry
        self.clients = clients
        self.metrics = metrics
        self.canary_prompt = canary_prompt
        self.run_once = run_once
        self.last_beat = time.monotonic()
        self.loop_errors = 0

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
                await asyncio.wait_for(stop.wait(), self.cfg.health_interval_s)
            except TimeoutError:
                pass  # the next round is due

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
        """Probe the given pairs (default: all) concurrently; one result dict per pair."""
        keys = self.registry.pair_keys() if keys is None else keys
        return list(await asyncio.gather(*(self.probe(k) for k in keys)))

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
        ok = error is None
        if error is not None:
            error = f"{route.describe()}: {error}"
        note = self.registry.mark_pair(key, ok, latency, error, time.monotonic())
        if note:
            log.warning("%s", note)
        self.metrics.deep_result(key, ok, latency)
        return {
            "prefill": p_url,
            "decode": d_url,
            "ok": ok,
            "latency_ms": round(latency * 1e3, 1),
            "error": error,
        }
