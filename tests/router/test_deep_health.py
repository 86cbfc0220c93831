"""/health/deep under a flood (issue 41, item 4): a real Router (router/app.py) over the real
worker API with a scripted engine (tests/router/channel_fakes.py), all in this process.

What must hold: however many callers, at most one canary is in flight at a time (counted where
the worker's engine receives them), every caller is answered with the result's age, client
requests are unaffected, a canary never runs past `--max-queue`, and a canary that is slow
because the pair is loaded does not take a pair that serves clients out of rotation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling import SamplingParams
from pdserve.router.app import Router
from pdserve.router.config import RouterConfig
from pdserve.router.health import DEEP_FRESH_S
from pdserve.worker.http.api import WorkerApi
from tests.router.channel_fakes import ScriptedEngine, run

CANARY = "deep-health-"


class CountingEngine(ScriptedEngine):
    """Counts the canaries live at once; `slow_canaries`: it never answers them (a pair so
    loaded that a canary waits past its bound while client requests still finish)."""

    vocab_size = 1 << 20  # the tiny tokenizer's ids pass the router's check

    def __init__(self, tick_s: float = 0.02, slow_canaries: bool = False) -> None:
        self.canaries = 0
        self.max_live_canaries = 0
        self.slow_canaries = slow_canaries
        super().__init__(tick_s)

    def submit(self, rid: str, prompt: list[int], params: SamplingParams, sink: Any, *a: Any):
        if rid.startswith(CANARY) and self.slow_canaries:
            with self.lock:
                self.canaries += 1
                self.submitted.append(rid)
            return  # held, unanswered, until the router aborts it
        super().submit(rid, prompt, params, sink, *a)
        if rid.startswith(CANARY):
            with self.lock:
                self.canaries += 1
                live = sum(r.startswith(CANARY) for r in self.live)
                self.max_live_canaries = max(self.max_live_canaries, live)


@asynccontextmanager
async def cluster(
    tiny_dir: Path, engine: CountingEngine, **cfg: Any
) -> AsyncIterator[tuple[str, Router]]:
    """One co-located fake worker (with /health) and a real Router over it on 127.0.0.1."""

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    wapi = WorkerApi(engine, "colocated", "tiny", {})
    wapp = web.Application()
    wapp.add_routes([*wapi.routes(), web.get("/health", health)])
    wrunner = web.AppRunner(wapp, handler_cancellation=True, shutdown_timeout=1.0)
    await wrunner.setup()
    await web.TCPSite(wrunner, "127.0.0.1", 0).start()
    worker = f"http://127.0.0.1:{wrunner.addresses[0][1]}"
    router = Router(
        RouterConfig((worker,), (), model_path=str(tiny_dir), **cfg),
        Tokenizer.from_dir(tiny_dir),
    )
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    await router.startup(session)
    rrunner = web.AppRunner(router.app(), handler_cancellation=True, shutdown_timeout=1.0)
    await rrunner.setup()
    await web.TCPSite(rrunner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{rrunner.addresses[0][1]}", router
    finally:
        await router._stop_monitor()
        await router.backend.close("test over")
        await rrunner.cleanup()
        await session.close()
        await wrunner.cleanup()
        engine.stop()


async def completion(s: aiohttp.ClientSession, url: str, max_tokens: int = 5) -> tuple[int, Any]:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True}
    async with s.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


def test_200_concurrent_callers_share_one_canary_and_clients_are_unaffected(tiny_dir):
    async def body() -> None:
        engine = CountingEngine()
        async with (
            cluster(tiny_dir, engine) as (url, router),
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s,
        ):
            await asyncio.sleep(0.2)  # the health loop's first liveness round
            t_end = time.monotonic() + 2.5
            answers: list[tuple[int, dict[str, Any]]] = []

            async def caller() -> None:
                while time.monotonic() < t_end:
                    async with s.get(url + "/health/deep") as r:
                        answers.append((r.status, await r.json()))

            async def client() -> list[tuple[int, Any]]:
                out = []
                while time.monotonic() < t_end:
                    out.append(await completion(s, url))
                return out

            t0 = time.monotonic()
            results = await asyncio.wait_for(
                asyncio.gather(*(caller() for _ in range(200)), *(client() for _ in range(8))),
                30,
            )
            elapsed = time.monotonic() - t0
            # Every caller was answered, every time, with the result and its age.
            assert len(answers) >= 200
            for status, doc in answers:
                assert status == 200 and doc["ok"], doc
                assert 0 <= doc["age_s"] < DEEP_FRESH_S + 1.0, doc
                assert [p["status"] for p in doc["pairs"]] == ["pass"], doc
            # At most one canary in flight, and at most one round per DEEP_FRESH_S.
            assert engine.max_live_canaries == 1
            assert 1 <= engine.canaries <= elapsed / DEEP_FRESH_S + 2, engine.canaries
            assert router.monitor.rounds == engine.canaries
            # The clients' requests: every one served in full.
            served = [r for group in results[200:] if group for r in group]
            assert served and all(
                status == 200 and doc["choices"][0]["finish_reason"] == "length"
                for status, doc in served
            ), served[:3]
            assert router.admission.in_flight == 0  # the canaries gave their slots back

    run(body())


def test_a_canary_never_runs_past_max_queue(tiny_dir):
    async def body() -> None:
        engine = CountingEngine(tick_s=0.01)
        async with (
            cluster(tiny_dir, engine, max_queue=1) as (url, router),
            aiohttp.ClientSession() as s,
        ):
            long = asyncio.ensure_future(completion(s, url, max_tokens=150))  # ~1.5 s
            while router.admission.in_flight == 0:
                await asyncio.sleep(0.01)
            async with s.get(url + "/health/deep") as r:  # no slot, and no result yet
                assert r.status == 429 and r.headers["Retry-After"], await r.text()
                doc = await r.json()
                assert doc["pairs"] == [] and "--max-queue" in doc["stale"], doc
            assert engine.canaries == 0 and router.monitor.skipped == 1
            assert (await long)[0] == 200
            async with s.get(url + "/health/deep") as r:  # a slot again: a canary runs
                assert r.status == 200 and (await r.json())["ok"]
            assert engine.canaries == 1 and router.admission.in_flight == 0

    run(body())


def test_a_canary_slow_on_a_pair_that_serves_clients_does_not_take_it_out(tiny_dir):
    async def body() -> None:
        engine = CountingEngine(tick_s=0.005, slow_canaries=True)
        async with (
            cluster(tiny_dir, engine, deep_timeout_s=0.5) as (url, router),
            aiohttp.ClientSession() as s,
        ):
            stop = asyncio.Event()

            async def load() -> None:  # client requests keep succeeding through the pair
                while not stop.is_set():
                    status, doc = await completion(s, url, max_tokens=3)
                    assert status == 200, doc

            clients = asyncio.ensure_future(load())
            async with s.get(url + "/health/deep") as r:
                doc = await r.json()
            assert r.status == 200 and doc["ok"], doc
            (pair,) = doc["pairs"]
            assert pair["status"] == "busy" and "did not finish within" in pair["error"], pair
            assert router.registry.in_rotation(router.registry.decode[0])
            stop.set()
            await clients
            # Without client traffic, the same timeout is a failure: the pair leaves rotation.
            await asyncio.sleep(DEEP_FRESH_S)
            async with s.get(url + "/health/deep") as r:
                doc = await r.json()
            assert r.status == 503 and doc["pairs"][0]["status"] == "fail", doc
            assert not router.registry.in_rotation(router.registry.decode[0])

    run(body())
