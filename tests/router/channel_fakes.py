"""Fakes for the output-channel tests: a scripted engine behind the real worker API, the
router's RemoteBackend on `--worker-streams shared`, and a sink that checks one finish."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams, validate_prompt
from pdserve.router.backend import RemoteBackend
from pdserve.router.client import WorkerClient
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import make_policy
from pdserve.router.registry import Registry
from pdserve.worker.http.api import WorkerApi


class ScriptedEngine:
    """Engine's validate/submit/abort: a thread emits token 0, 1, ... for every live request
    each `tick_s`, and the finish "length" with the last (none at all when `frozen`)."""

    max_model_len = 4096
    vocab_size = 100
    cfg = SimpleNamespace(request_timeout_s=30.0)

    def __init__(self, tick_s: float = 0.002, frozen: bool = False) -> None:
        self.tick_s, self.frozen = tick_s, frozen
        self.lock = threading.Lock()
        self.live: dict[str, list[Any]] = {}  # request id -> [sink, tokens sent, max tokens]
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_ids, params, self.vocab_size, self.max_model_len)

    def submit(self, rid: str, prompt: list[int], params: SamplingParams, sink: Any, *a: Any):
        self.validate(prompt, params)  # as an engine's submit does
        with self.lock:
            self.submitted.append(rid)
            self.live[rid] = [sink, 0, params.max_tokens]

    def abort(self, rid: str) -> None:
        with self.lock:
            self.aborted.append(rid)
            entry = self.live.pop(rid, None)
        if entry is not None:
            entry[0](RequestOutput(rid, (), (), "abort"))

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            if self.frozen:
                continue
            with self.lock:
                emit = []
                for rid, entry in list(self.live.items()):
                    entry[1] += 1
                    done = entry[1] >= entry[2]
                    emit.append((entry[0], RequestOutput(rid, (entry[1] - 1,), (), None)))
                    if done:
                        emit[-1] = (entry[0], RequestOutput(rid, (entry[1] - 1,), (), "length"))
                        del self.live[rid]
            for sink, out in emit:
                sink(out)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@asynccontextmanager
async def worker(engine: ScriptedEngine) -> AsyncIterator[tuple[str, WorkerApi]]:
    wapi = WorkerApi(engine, "colocated", "m", {})
    app = web.Application()
    app.add_routes(wapi.routes())
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", wapi
    finally:
        await runner.cleanup()
        engine.stop()


def backend(
    session: aiohttp.ClientSession, urls: list[str], open_timeout_s: float = 3.0
) -> RemoteBackend:
    cfg = RouterConfig(
        tuple(urls),
        (),
        model_path="unused",
        abort_timeout_s=1.0,
        connect_timeout_s=open_timeout_s,
    )
    reg = Registry.build([(u, {}) for u in urls], [], make_policy("round-robin"))
    clients = {u: WorkerClient(session, u, 1.0) for u in urls}
    return RemoteBackend(cfg, reg, clients, RouterMetrics(), vocab_size=100, max_model_len=4096)


class Collected:
    def __init__(self) -> None:
        self.outs: dict[str, list[RequestOutput]] = {}
        self.done: dict[str, asyncio.Event] = {}

    def sink(self, rid: str) -> Any:
        self.outs[rid], self.done[rid] = [], asyncio.Event()

        def put(o: RequestOutput) -> None:
            assert o.request_id == rid
            assert not self.done[rid].is_set(), f"an output of {rid} after its finish"
            self.outs[rid].append(o)
            if o.finish_reason is not None:
                self.done[rid].set()

        return put

    async def wait(self, *rids: str, timeout_s: float = 10.0) -> None:
        await asyncio.wait_for(asyncio.gather(*(self.done[r].wait() for r in rids)), timeout_s)

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outs[rid] for t in o.token_ids]

    def finish(self, rid: str) -> RequestOutput:
        return self.outs[rid][-1]


def submit(b: RemoteBackend, c: Collected, rid: str, max_tokens: int, timeout_s: float = 10.0):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    b.submit(rid, [1, 2, 3], params, c.sink(rid), timeout_s)


async def until(cond: Any, timeout_s: float = 5.0) -> None:
    t_end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < t_end, "condition not met in time"
        await asyncio.sleep(0.01)


def run(coro: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await asyncio.wait_for(coro, 60)

    return asyncio.run(main())


@asynccontextmanager
async def fake_worker(routes: list[web.RouteDef]) -> AsyncIterator[str]:
    """An aiohttp app with `routes` on 127.0.0.1: a worker that misbehaves as told."""
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
