"""A client that resets its connection aborts its request, in every window of the request's
life (LESSONS #17): right after sending a streaming or a plain request (the response has not
started), once the response head arrived, after the first token.

A real Listener and OpenAIApi in this process over a fake engine that generates a token every
few ms until its max_tokens or an abort, and records both. The clients are the chaos
scenario's (`pdserve.chaos.resets.reset_one`): raw sockets closed with an RST.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from pdserve.chaos.resets import WINDOWS, request_bytes, reset_one
from pdserve.frontend.api import OpenAIApi
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams, validate_prompt
from pdserve.server.connection import on_disconnect
from pdserve.server.errors import error_middleware
from pdserve.server.listener import HttpLimits, Listener, bind
from tests.frontend.fakes import Tokenizer

VOCAB, MAX_LEN = 100, 4096
TOKEN_S = 0.005  # the fake engine's step
QUIET_S = 1.0  # a reset request is aborted within this (the bound)
WAIT_S = 10.0


# The request being handled, for an engine that drops its client's connection on submit.
CURRENT: contextvars.ContextVar[web.Request] = contextvars.ContextVar("current")


@web.middleware
async def remember(request: web.Request, handler: Any) -> web.StreamResponse:
    CURRENT.set(request)
    return await handler(request)


class Engine:
    """Emits one token per TOKEN_S for each live request; `live` is what still runs.
    `drop_client`: submit resets the request's connection (the client is gone between the
    submit and the response's first byte)."""

    def __init__(self, drop_client: bool = False) -> None:
        self.drop_client = drop_client
        self.live: dict[str, asyncio.Task[None]] = {}
        self.submitted: list[str] = []
        self.aborted: list[str] = []

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_ids, params, VOCAB, MAX_LEN)

    def submit(self, rid: str, prompt: list[int], params: SamplingParams, sink: Any,
               timeout_s: Any = None, **extra: Any) -> None:  # fmt: skip
        async def generate() -> None:
            try:
                for i in range(params.max_tokens):
                    await asyncio.sleep(TOKEN_S)
                    last = i == params.max_tokens - 1
                    sink(RequestOutput(rid, (i % 26,), (), "length" if last else None))
            finally:
                self.live.pop(rid, None)

        self.submitted.append(rid)
        self.live[rid] = asyncio.get_running_loop().create_task(generate())
        transport = CURRENT.get().transport
        if self.drop_client and transport is not None:
            transport.abort()

    def abort(self, rid: str) -> None:
        task = self.live.pop(rid, None)
        if task is not None:
            self.aborted.append(rid)
            task.cancel()


@asynccontextmanager
async def serving(
    engine: Engine, routes: list[web.RouteDef] = (), cancel_handlers: bool = True
) -> AsyncIterator[str]:
    listener = Listener(bind("127.0.0.1", 0), HttpLimits())
    api = OpenAIApi(engine, Tokenizer(), "m", MAX_LEN, 60.0)
    app = web.Application(middlewares=[listener.middleware(), error_middleware(), remember])
    app.add_routes([*api.routes(), *routes])
    runner = web.AppRunner(
        app, handler_cancellation=cancel_handlers, access_log=None, shutdown_timeout=1
    )
    await runner.setup()
    await listener.start(runner)
    try:
        yield f"http://127.0.0.1:{listener.port}"
    finally:
        listener.stop_accepting()
        await runner.cleanup()
        api.close()


async def clients(url: str, window: str, payloads: list[bytes]) -> None:
    """Each reset 0 to 49 ms after its window is reached, so that the resets land all over
    the handler's life, not all before it starts (as they do when nothing separates them)."""
    pauses = [(n % 50) / 1000 for n in range(len(payloads))]
    resets = (reset_one(url, window, p, s) for p, s in zip(payloads, pauses, strict=True))
    await asyncio.gather(*resets)


async def quiet(engine: Engine) -> float:
    """Seconds until nothing runs; fails past QUIET_S."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while engine.live:
        assert loop.time() - t0 < QUIET_S, f"{len(engine.live)} requests outlived their client"
        await asyncio.sleep(0.01)
    return loop.time() - t0


@pytest.mark.parametrize("window", WINDOWS)
def test_a_reset_in_each_window_aborts_every_request(window):
    async def go() -> None:
        engine = Engine()
        async with serving(engine) as url:
            # The clients on a loop of their own, as another process's would be: their
            # resets interleave with the server's turns instead of all landing before them.
            # On a busy machine a whole storm can reset before any handler reaches the
            # engine: storm again (at most 5 times) until some did.
            for _ in range(5):
                payloads = [request_bytes(url, window, n, 2000, {}) for n in range(200)]
                await asyncio.to_thread(asyncio.run, clients(url, window, payloads))
                await asyncio.sleep(0.1)  # what the server still had in hand reaches it
                await quiet(engine)
                if engine.submitted:
                    break
            assert engine.submitted, "no request reached the engine: the test tested nothing"
            assert sorted(engine.aborted) == sorted(engine.submitted)
            # and the server still serves
            reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
            writer.write(request_bytes(url, "plain-sent", 10_000, 3, {}))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
            assert head.startswith(b"HTTP/1.1 200"), head
            writer.close()

    asyncio.run(go())


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_after_the_submit_is_aborted_even_if_its_handler_is_not_cancelled(stream):
    """What the first storm found: aiohttp's cancel of the handler was lost (Python 3.11's
    wait_for swallows one that lands as the body read completes), then the generation
    started, and a streaming answer's prepare() raised on the closed transport (nothing
    aborted it) or a plain one waited for its end. Served here without handler cancellation,
    the connection's own watch must abort it."""

    async def go() -> None:
        engine = Engine(drop_client=True)
        async with serving(engine, cancel_handlers=False) as url:
            window = "stream-sent" if stream else "plain-sent"
            reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
            writer.write(request_bytes(url, window, 0, 2000, {}))
            assert await asyncio.wait_for(reader.read(), WAIT_S) == b""  # dropped, unanswered
            await quiet(engine)
            assert len(engine.submitted) == 1 and engine.aborted == engine.submitted

    asyncio.run(go())


def test_the_disconnect_watch_runs_even_when_the_handler_is_never_cancelled():
    """The watch is tied to the connection, not to the handler task's cancellation (which
    asyncio.wait_for on Python 3.11 can swallow): a handler that shields itself still has its
    callback run when its client resets."""
    ran = asyncio.Event()
    handler_done = asyncio.Event()

    async def stubborn(request: web.Request) -> web.Response:
        unwatch = on_disconnect(request, ran.set)
        try:
            await asyncio.shield(asyncio.sleep(0.5))  # a cancel lands here and is lost...
        except asyncio.CancelledError:
            pass  # ...as if swallowed
        finally:
            unwatch()
            handler_done.set()
        return web.json_response({})

    async def go() -> None:
        async with serving(Engine(), [web.post("/stubborn", stubborn)]) as url:
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /stubborn HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)  # the handler is running
            assert not ran.is_set()
            writer.transport.abort()
            await asyncio.wait_for(ran.wait(), WAIT_S)
            await asyncio.wait_for(handler_done.wait(), WAIT_S)

    asyncio.run(go())


def test_a_finished_request_is_not_watched_any_longer():
    """unwatch() after the answer: a later disconnect of the kept-alive connection runs
    nothing for the finished request."""
    calls: list[str] = []

    async def quick(request: web.Request) -> web.Response:
        unwatch = on_disconnect(request, lambda: calls.append("lost"))
        unwatch()
        return web.json_response({})

    async def go() -> None:
        async with serving(Engine(), [web.post("/quick", quick)]) as url:
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /quick HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"{}"), WAIT_S)
            writer.transport.abort()
            await asyncio.sleep(0.1)
            assert calls == []

    asyncio.run(go())
