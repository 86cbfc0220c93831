"""The router's output channel against workers that misbehave (router/channel.py,
RemoteBackend._on_channel): each failure ends a request in exactly one finish that names the
worker, every wait is bounded, a request the router gave up on is aborted on the worker, and a
stale channel is replaced without taking a healthy worker out of rotation."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
from aiohttp import web

from pdserve.protocol.generate import Generate
from pdserve.protocol.outputs import RequestOutput, encode_line
from pdserve.router import backend as backend_mod
from pdserve.router import channel as channel_mod
from pdserve.worker.http import channels as worker_channels
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


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def test_a_refused_channel_reroutes_and_takes_the_worker_out():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{sock.getsockname()[1]}"  # closed again below: refused

    async def body() -> None:
        async with worker(ScriptedEngine()) as (url, _), aiohttp.ClientSession() as s:
            b, c = backend(s, [gone, url]), Collected()
            for i in range(4):
                submit(b, c, f"r{i}", 3)
            await c.wait(*(f"r{i}" for i in range(4)))
            assert all(c.tokens(f"r{i}") == [0, 1, 2] for i in range(4))
            assert not b.registry.in_rotation(b.registry.decode[0])
            await b.close("test over")

    run(body())


def test_a_request_the_router_times_out_is_aborted_on_the_worker(monkeypatch):
    monkeypatch.setattr(backend_mod, "REMOTE_GRACE_S", 0.2)  # the worker's own net is 10 s

    async def body() -> None:
        engine = ScriptedEngine(frozen=True)
        async with worker(engine) as (url, wapi), aiohttp.ClientSession() as s:
            b, c = backend(s, [url]), Collected()
            submit(b, c, "slow", 5, timeout_s=0.3)
            await c.wait("slow", timeout_s=3.0)
            f = c.finish("slow")
            assert f.finish_reason == "error" and "did not finish within" in (f.error or "")
            await until(lambda: "slow" in engine.aborted, 2.0)
            await b.close("test over")

    run(body())


def test_a_finish_before_the_generate_answer_is_the_one_finish():
    async def outputs(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await submitted.wait()
        await resp.write(encode_line(RequestOutput("r1", (5, 6), (), "length")))
        await asyncio.sleep(5)
        return resp

    async def generate(request: web.Request) -> web.Response:
        submitted.set()
        await asyncio.sleep(0.2)  # the finish overtakes the answer, which then fails
        return web.json_response({"error": {"message": "boom"}}, status=500)

    async def body() -> None:
        routes = [web.post("/outputs", outputs), web.post("/generate", generate)]
        async with fake_worker(routes) as url, aiohttp.ClientSession() as s:
            b, c = backend(s, [url]), Collected()
            submit(b, c, "r1", 5)
            await c.wait("r1")
            await asyncio.sleep(0.4)  # Collected fails on anything after the finish
            assert [o.finish_reason for o in c.outs["r1"]] == ["length"]
            assert b.metrics.registry.get_sample_value(
                "pdserve_router_requests_total", {"outcome": "ok"}
            )
            await b.close("test over")

    submitted = asyncio.Event()
    run(body())


def test_a_stale_channel_is_replaced_and_the_worker_stays_in_rotation():
    async def body() -> None:
        async with worker(ScriptedEngine()) as (url, wapi), aiohttp.ClientSession() as s:
            b, c = backend(s, [url]), Collected()
            submit(b, c, "before", 3)
            await c.wait("before")
            # The worker forgets the channel while its stream stays open (as after a restart
            # behind a connection that was never reset).
            (ch,) = list(wapi.channels._open.values())
            wapi.channels.remove(ch)
            submit(b, c, "after", 3)
            await c.wait("after")
            assert c.tokens("after") == [0, 1, 2]
            assert b.channels[url].opened == 2
            assert b.registry.in_rotation(b.registry.decode[0])
            await b.close("test over")

    run(body())


def test_a_silent_stream_is_declared_dead():
    async def outputs(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await asyncio.sleep(30)  # not even a heartbeat: the host is gone
        return resp

    async def body() -> None:
        routes = [web.post("/outputs", outputs), web.post("/generate", ok)]
        async with fake_worker(routes) as url, aiohttp.ClientSession() as s:
            b, c = backend(s, [url]), Collected()
            b.channels[url].silence_s = 0.5
            t0 = time.monotonic()
            submit(b, c, "r1", 5)
            await c.wait("r1", timeout_s=5.0)
            f = c.finish("r1")
            assert f.finish_reason == "error" and url in (f.error or "")
            assert "nothing for 0.5s" in (f.error or "")
            assert time.monotonic() - t0 < 3.0
            await b.close("test over")

    run(body())


def test_an_opening_answered_with_headers_but_no_body_is_bounded():
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 503 Busy\r\nContent-Length: 100\r\n\r\n")  # and no body
        await asyncio.sleep(30)

    async def body() -> None:
        server = await asyncio.start_server(stall, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            async with aiohttp.ClientSession() as s:
                b, c = backend(s, [url], open_timeout_s=0.5), Collected()
                t0 = time.monotonic()
                submit(b, c, "r1", 5)
                await c.wait("r1", timeout_s=5.0)
                assert c.finish("r1").finish_reason == "error"
                assert time.monotonic() - t0 < 3.0
                await b.close("test over")
        finally:
            server.close()

    run(body())


def test_a_request_cancelled_while_the_channel_opens_leaves_the_opening_alone():
    async def outputs(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.3)
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(3):
            await asyncio.sleep(0.05)
            await resp.write(
                encode_line(RequestOutput("r2", (i,), (), "length" if i == 2 else None))
            )
        await asyncio.sleep(5)
        return resp

    async def body() -> None:
        routes = [web.post("/outputs", outputs), web.post("/generate", ok), web.post("/abort", ok)]
        async with fake_worker(routes) as url, aiohttp.ClientSession() as s:
            b, c = backend(s, [url]), Collected()
            submit(b, c, "r1", 5)
            await asyncio.sleep(0.05)
            b.abort("r1")  # waiting in ready()
            submit(b, c, "r2", 5)
            await c.wait("r2")
            assert c.tokens("r2") == [0, 1, 2] and b.channels[url].opened == 1
            await b.close("test over")

    run(body())


def test_outputs_of_a_request_aborted_in_vain_abort_it_again(monkeypatch):
    monkeypatch.setattr(channel_mod, "ORPHAN_ABORT_AFTER_S", 0.2)
    aborts: list[float] = []

    async def outputs(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await submitted.wait()
        for i in range(100):  # whatever the aborts say
            await resp.write(encode_line(RequestOutput("r1", (i,))))
            await asyncio.sleep(0.02)
        return resp

    async def generate(request: web.Request) -> web.Response:
        submitted.set()
        return web.json_response({"ok": True})

    async def abort(request: web.Request) -> web.Response:
        assert (await request.json()) == {"request_ids": ["r1"]}
        aborts.append(time.monotonic())
        return web.json_response({"ok": True})

    async def body() -> None:
        routes = [
            web.post("/outputs", outputs),
            web.post("/generate", generate),
            web.post("/abort", abort),
        ]
        async with fake_worker(routes) as url, aiohttp.ClientSession() as s:
            b, c = backend(s, [url]), Collected()
            submit(b, c, "r1", 1000)
            await until(lambda: len(c.outs["r1"]) > 2)
            b.abort("r1")
            await until(lambda: len(aborts) >= 2, 2.0)
            assert aborts[1] - aborts[0] >= 0.15
            await b.close("test over")

    submitted = asyncio.Event()
    run(body())


def test_a_bad_line_on_the_stream_fails_every_request_on_it_naming_the_worker():
    async def outputs(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await submitted.wait()
        await resp.write(encode_line(RequestOutput("r1", (5,))) + b'{"request_id": 3}\n')
        await asyncio.sleep(5)
        return resp

    async def generate(request: web.Request) -> web.Response:
        submitted.set()
        return web.json_response({"ok": True})

    async def body() -> None:
        routes = [web.post("/outputs", outputs), web.post("/generate", generate)]
        async with fake_worker(routes) as url, aiohttp.ClientSession() as s:
            b, c = backend(s, [url]), Collected()
            submit(b, c, "r1", 5)
            await c.wait("r1")
            f = c.finish("r1")
            assert f.finish_reason == "error"
            assert url in (f.error or "") and "bad stream" in (f.error or "")
            await b.close("test over")

    submitted = asyncio.Event()
    run(body())


def test_register_refuses_a_channel_that_ended_after_ready():
    async def body() -> None:
        async with worker(ScriptedEngine()) as (url, _), aiohttp.ClientSession() as s:
            b = backend(s, [url])
            ch = b.channels[url]
            cid = await ch.ready()
            ch.reset(cid)  # ended between ready() and register()
            receiver = channel_mod.Receiver(lambda o: None, lambda what: None)
            assert not ch.register(cid, "r", receiver)
            assert await ch.ready() != cid and ch.opened == 2
            await b.close("test over")

    run(body())


def test_an_idle_channel_writes_heartbeats(monkeypatch):
    monkeypatch.setattr(worker_channels, "CHANNEL_HEARTBEAT_S", 0.05)

    async def body() -> None:
        async with (
            worker(ScriptedEngine()) as (url, _),
            aiohttp.ClientSession() as s,
            s.post(url + "/outputs", json={"channel": "c"}) as r,
        ):
            assert r.status == 200
            got = await asyncio.wait_for(r.content.readexactly(3), 2.0)
            assert got == b"\n\n\n"

    run(body())


def test_a_full_worker_refuses_more_requests_with_503(monkeypatch):
    monkeypatch.setattr(worker_channels, "MAX_LIVE", 2)

    async def body() -> None:
        async with (
            worker(ScriptedEngine(frozen=True)) as (url, _),
            aiohttp.ClientSession() as s,
            s.post(url + "/outputs", json={"channel": "c"}) as stream,
        ):
            assert stream.status == 200
            statuses = []
            for i in range(3):
                gen = {"request_id": f"r{i}", "prompt_ids": [1], "channel": "c"}
                async with s.post(url + "/generate", json=gen) as r:
                    statuses.append((r.status, (await r.json()).get("error", {}).get("code")))
            assert statuses == [(200, None), (200, None), (503, "worker_full")]

    run(body())


def test_a_canary_is_held_to_its_own_bound_while_the_channel_opens():
    async def outputs(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(30)  # never answers
        return web.StreamResponse()

    async def body() -> None:
        routes = [web.post("/outputs", outputs), web.post("/generate", ok)]
        async with fake_worker(routes) as url, aiohttp.ClientSession() as s:
            b = backend(s, [url], open_timeout_s=5.0)
            route = b.registry.choose()
            t0 = time.monotonic()
            try:
                await b.run_once(route, Generate(request_id="deep-1", prompt_ids=[1]), 0.3)
            except backend_mod.WorkerError as e:
                assert "no output stream within 0.3s" in e.what
            else:
                raise AssertionError("run_once returned without an output stream")
            assert time.monotonic() - t0 < 2.0
            await b.close("test over")

    run(body())


def test_after_close_nothing_opens_a_channel_again():
    async def body() -> None:
        async with worker(ScriptedEngine()) as (url, wapi), aiohttp.ClientSession() as s:
            b = backend(s, [url])
            await b.close("the router is shutting down")
            route = b.registry.choose()
            for call in (
                b.run_once(route, Generate(request_id="deep-2", prompt_ids=[1]), 1.0),
                b.channels[url].ready(),
            ):
                try:
                    await call
                except backend_mod.WorkerError:
                    pass
                else:
                    raise AssertionError("a closed backend opened a channel")
            assert b.channels[url].opened == 0 and len(wapi.channels) == 0

    run(body())
