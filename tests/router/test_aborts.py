"""Aborts in bulk: a client that dies with many streams open costs each worker one POST /abort
(RemoteBackend batches the aborts of one loop turn), and the worker checks every id of a batch
before any reaches its engine."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pdserve.protocol.outputs import MAX_ABORT_IDS
from tests.router.channel_fakes import (
    Collected,
    ScriptedEngine,
    backend,
    fake_worker,
    run,
    submit,
    until,
    worker,
)


def test_sixty_aborts_in_one_loop_turn_are_one_post_per_worker():
    async def body() -> None:
        engine = ScriptedEngine(tick_s=0.005)
        async with worker(engine) as (url, _), aiohttp.ClientSession() as s:
            b, c = backend(s, [url]), Collected()
            rids = [f"s{i}" for i in range(60)]
            for rid in rids:
                submit(b, c, rid, 1000)
            await until(lambda: all(c.outs[r] for r in rids))
            posts: list[list[str]] = []
            real_abort = b.clients[url].abort

            async def counting(ids: Any, timeout_s: float) -> None:
                posts.append(list(ids))
                await real_abort(ids, timeout_s)

            b.clients[url].abort = counting  # type: ignore[method-assign]
            for rid in rids:  # as the front end does when the client's connections drop
                b.abort(rid)
            await until(lambda: set(rids) <= set(engine.aborted), 2.0)
            assert posts == [rids]
            await b.close("test over")

    run(body())


def test_more_aborts_than_one_post_takes_are_split():
    seen: list[list[str]] = []

    async def abort(request: web.Request) -> web.Response:
        seen.append((await request.json())["request_ids"])
        return web.json_response({"ok": True})

    async def body() -> None:
        async with fake_worker([web.post("/abort", abort)]) as url, aiohttp.ClientSession() as s:
            b = backend(s, [url])
            ids = [f"r{i}" for i in range(MAX_ABORT_IDS + 5)]
            for rid in ids:
                b._send_abort(url, rid)
            await until(lambda: sum(len(x) for x in seen) == len(ids), 3.0)
            assert sorted(len(x) for x in seen) == [5, MAX_ABORT_IDS]
            await b.close("test over")

    run(body())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"request_ids": []}, "request_ids"),
        ({"request_ids": "r1"}, "request_ids"),
        ({"request_ids": ["r1", 5]}, "request_ids"),
        ({"request_ids": ["r1", ""]}, "request_ids"),
        ({"request_ids": [f"r{i}" for i in range(MAX_ABORT_IDS + 1)]}, "request_ids"),
        ({"request_ids": ["r1"], "request_id": "r2"}, "request_id"),
        ({"request_ids": ["r1"], "why": "x"}, "why"),
        (["r1"], "request_id"),
        (7, "request_id"),
        ({}, "request_id"),
    ],
)
def test_a_bad_abort_batch_is_refused_whole(body, param):
    async def main() -> None:
        engine = ScriptedEngine()
        async with (
            worker(engine) as (url, _),
            aiohttp.ClientSession() as s,
            s.post(url + "/abort", json=body) as r,
        ):
            assert r.status == 400
            assert (await r.json())["error"]["param"] == param
            assert engine.aborted == []  # not even the good ids of the batch

    run(main())


def test_an_abort_batch_reaches_the_engine_whole():
    async def main() -> None:
        engine = ScriptedEngine()
        async with (
            worker(engine) as (url, _),
            aiohttp.ClientSession() as s,
            s.post(url + "/abort", json={"request_ids": ["a", "b", "c"]}) as r,
        ):
            assert r.status == 200 and await r.json() == {"ok": True}
            assert engine.aborted == ["a", "b", "c"]

    run(main())


def test_repeated_ids_reach_the_engine_once_and_one_id_is_not_a_list():
    async def main() -> None:
        engine = ScriptedEngine()
        async with (
            worker(engine) as (url, _),
            aiohttp.ClientSession() as s,
            s.post(url + "/abort", json={"request_ids": ["a"] * 100 + ["b"]}) as r,
        ):
            assert r.status == 200
            assert engine.aborted == ["a", "b"]
            client = backend(s, [url]).clients[url]
            with pytest.raises(TypeError):
                await client.abort("ab", 1.0)  # would abort "a" and "b"

    run(main())
