"""--max-queue: generation calls past the limit get 429 with Retry-After, and nothing else."""

from __future__ import annotations

import asyncio

from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

from pdserve.server.admission import Admission


async def _run() -> None:
    gate = Admission(max_queue=2)
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"ok": True})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application(middlewares=[gate.middleware()])
    app.add_routes([web.post("/v1/completions", slow), web.get("/health", health)])
    async with TestServer(app) as server, ClientSession() as session:
        url = str(server.make_url("/v1/completions"))
        first = [asyncio.create_task(session.post(url, json={})) for _ in range(2)]
        while gate.in_flight < 2:
            await asyncio.sleep(0.01)
        async with session.post(url, json={}) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "1"
            body = await r.json()
            assert (
                body["error"]["code"] == "queue_full"
                and "--max-queue 2" in body["error"]["message"]
            )
        async with session.get(str(server.make_url("/health"))) as r:
            assert r.status == 200  # never counted, never refused
        release.set()
        for t in first:
            resp = await t
            assert resp.status == 200
            resp.release()
        assert gate.in_flight == 0 and gate.refused == 1
        async with session.post(url, json={}) as r:  # room again once the others ended
            assert r.status == 200


def test_calls_past_the_limit_get_429_and_the_rest_are_served():
    asyncio.run(_run())
