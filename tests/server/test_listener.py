"""HTTP limits on a real listening socket (server/listener.py, server/connection.py).

Each test serves a small aiohttp app through `Listener` with short limits and talks to it
over raw sockets, as slow or hostile clients would: a slow header, an idle connection,
connections past the cap, a client that stops reading, a malformed request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from pdserve.server.errors import error_middleware
from pdserve.server.listener import HttpLimits, Listener, bind

LIMITS = HttpLimits(max_connections=4, idle_timeout_s=0.3, header_timeout_s=0.6, write_stall_s=0.5)
WAIT_S = 10.0  # the bound on every wait below; the limits above are far shorter


async def hello(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


@asynccontextmanager
async def serving(
    limits: HttpLimits = LIMITS, routes: list[web.RouteDef] | None = None
) -> AsyncIterator[Listener]:
    listener = Listener(bind("127.0.0.1", 0), limits)
    app = web.Application(middlewares=[listener.middleware(), error_middleware()])
    app.add_routes([web.get("/hello", hello), *(routes or [])])
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1)
    await runner.setup()
    await listener.start(runner)
    try:
        yield listener
    finally:
        listener.stop_accepting()
        await runner.cleanup()


async def connect(listener: Listener) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", listener.port)


async def get(listener: Listener, path: str = "/hello") -> tuple[int, dict[str, str], Any]:
    """One request on a new connection: (status, headers, JSON body)."""
    reader, writer = await connect(listener)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    raw = await asyncio.wait_for(reader.read(), WAIT_S)
    writer.close()
    return parse(raw)


def parse(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body) if body else None


async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before closing; fails if it did not close within WAIT_S."""
    return await asyncio.wait_for(reader.read(), WAIT_S)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def test_a_slow_header_is_cut_off_while_a_normal_request_is_served():
    async def go() -> None:
        async with serving() as listener:
            reader, writer = await connect(listener)
            writer.write(b"GET /hello HTTP/1.1\r\nHost: x\r\n")  # ... and never the rest
            trickle = asyncio.ensure_future(_trickle(writer))
            assert (await get(listener))[0] == 200  # served while the slow one waits
            assert await closed_by_server(reader) == b""
            trickle.cancel()
            assert listener.stats["header_timeouts"] == 1
            assert (await get(listener))[0] == 200

    run(go)


async def _trickle(writer: asyncio.StreamWriter) -> None:
    """A header line byte by byte, faster than the idle timeout: only the head's bound holds."""
    while True:
        writer.write(b"X")
        await asyncio.sleep(0.05)


def test_an_idle_connection_is_closed_and_a_kept_alive_one_after_its_response():
    async def go() -> None:
        async with serving() as listener:
            reader, writer = await connect(listener)
            assert await closed_by_server(reader) == b""  # never sent a byte
            reader, writer = await connect(listener)
            writer.write(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")  # keep-alive
            answer = await closed_by_server(reader)  # the answer, then idle, then closed
            assert parse(answer)[0] == 200
            assert listener.stats["idle_closed"] == 2 and not listener.connections

    run(go)


def test_connections_past_the_cap_get_503_and_a_normal_request_is_served_after():
    async def go() -> None:
        async with serving() as listener:
            held = [await connect(listener) for _ in range(LIMITS.max_connections)]
            extra = [await connect(listener) for _ in range(6)]
            for reader, _ in extra:  # answered at once, before they sent anything
                status, headers, body = parse(await closed_by_server(reader))
                assert status == 503 and headers["Retry-After"] == "1"
                assert body["error"]["code"] == "too_many_connections"
            assert listener.stats["refused"] == 6
            assert len(listener.connections) == LIMITS.max_connections
            # The held ones are idle: they are closed, and a normal request is served.
            for reader, _ in held:
                assert await closed_by_server(reader) == b""
            assert (await get(listener))[0] == 200

    run(go)


def test_a_client_that_stops_reading_is_cut_off_and_its_handler_ends():
    ended: list[str] = []

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        try:
            while True:
                await resp.write(b"x" * 65536)
        except (asyncio.CancelledError, ConnectionError) as e:
            ended.append(type(e).__name__)
            raise

    async def go() -> None:
        async with serving(routes=[web.get("/endless", endless)]) as listener:
            reader, writer = await connect(listener)
            writer.write(b"GET /endless HTTP/1.1\r\nHost: x\r\n\r\n")  # ... and never reads
            for _ in range(int(WAIT_S / 0.05)):
                if ended:
                    break
                await asyncio.sleep(0.05)
            assert ended and listener.stats["write_stalls"] == 1
            assert (await get(listener))[0] == 200
            writer.close()

    run(go)


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE / HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 10000 + b"\r\n\r\n",
    ],
)
def test_a_malformed_request_is_a_json_400_and_one_info_line(raw, caplog):
    async def go() -> None:
        async with serving() as listener:
            reader, writer = await connect(listener)
            writer.write(raw)
            status, _, body = parse(await closed_by_server(reader))
            assert status == 400 and body["error"]["code"] == "bad_http"
            assert (await get(listener))[0] == 200

    with caplog.at_level(logging.INFO):
        run(go)
    bad = [r for r in caplog.records if "bad HTTP" in r.getMessage()]
    assert len(bad) == 1 and bad[0].levelno == logging.INFO and bad[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_limits_are_checked():
    with pytest.raises(ValueError, match="idle_timeout_s"):
        HttpLimits(idle_timeout_s=0)
    with pytest.raises(ValueError, match="max_connections"):
        HttpLimits(max_connections=0)
