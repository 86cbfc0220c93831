"""The OpenAI front end's surface and its use of the event loop (frontend/api.py).

Real aiohttp apps in this process over a fake engine: tokenizing runs on the tokenizer
threads, so a tokenizer that blocks leaves /health answering; `GET /v1/models/{id}`; a slow
body is a 408; a shutdown's `abort_all` ends what runs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pdserve.frontend.api import OpenAIApi
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams, validate_prompt
from pdserve.server import body as server_body
from pdserve.server.errors import error_middleware

VOCAB, MAX_LEN = 100, 64
WAIT_S = 10.0


class Engine:
    """validate/submit/abort; answers each request with one token, or holds it (`hold`)."""

    def __init__(self, hold: bool = False) -> None:
        self.hold = hold
        self.sinks: dict[str, Callable[[RequestOutput], None]] = {}
        self.aborted: list[str] = []

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_ids, params, VOCAB, MAX_LEN)

    def submit(self, rid: str, prompt: list[int], params: Any, sink: Any, timeout_s: Any = None,
               **extra: Any) -> None:  # fmt: skip
        self.sinks[rid] = sink
        if not self.hold:
            sink(RequestOutput(rid, (7,), (), "length", None, len(prompt)))

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        self.sinks[rid](RequestOutput(rid, (), (), "abort", None, 0))


class BlockingTokenizer:
    """encode() waits for `release`; records which thread it ran on, and when it returned."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.returned = threading.Event()
        self.threads: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        try:
            if not self.release.wait(WAIT_S):
                raise RuntimeError("never released")
            return [ord(c) % VOCAB for c in text]
        finally:
            self.returned.set()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        return "".join(m["content"] for m in messages)

    def incremental(self, skip_special_tokens: bool = True) -> Any:
        return SimpleNamespace(push=lambda t: chr(97 + t % 26), flush=lambda: "")


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def app_with(api: OpenAIApi) -> web.Application:
    app = web.Application(middlewares=[error_middleware()])
    app.add_routes([*api.routes(), web.get("/health", health)])
    return app


def test_a_blocking_tokenizer_does_not_block_the_loop():
    tok = BlockingTokenizer()
    api = OpenAIApi(Engine(), tok, "org/m", MAX_LEN, 5.0)

    async def go() -> None:
        async with TestClient(TestServer(app_with(api))) as client:
            for path, body in [
                ("/v1/completions", {"prompt": "hello", "max_tokens": 1}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ]:
                tok.entered.clear()
                tok.release.clear()
                tok.returned.clear()
                call = asyncio.ensure_future(client.post(path, json=body))
                assert await asyncio.to_thread(tok.entered.wait, WAIT_S)
                r = await asyncio.wait_for(client.get("/health"), WAIT_S)
                assert r.status == 200 and not tok.returned.is_set()  # answered while blocked
                tok.release.set()
                resp = await asyncio.wait_for(call, WAIT_S)
                assert resp.status == 200, await resp.text()
        assert tok.threads and all(t.startswith("tokenize") for t in tok.threads)

    try:
        asyncio.run(go())
    finally:
        tok.release.set()
        api.close()


def test_models_by_id():
    api = OpenAIApi(Engine(), BlockingTokenizer(), "org/m:v1", MAX_LEN, 5.0)

    async def go() -> None:
        async with TestClient(TestServer(app_with(api))) as client:
            r = await client.get("/v1/models/org/m:v1")  # ids may hold '/' and ':'
            card = await r.json()
            assert r.status == 200 and card["id"] == "org/m:v1" and card["object"] == "model"
            r = await client.get("/v1/models/other")
            body = await r.json()
            assert r.status == 404 and body["error"]["code"] == "model_not_found"
            assert "other" in body["error"]["message"]
            r = await client.post("/v1/models/org/m:v1")
            assert r.status == 405 and (await r.json())["error"]["type"]

    asyncio.run(go())
    api.close()


def test_a_body_that_does_not_arrive_in_time_is_408(monkeypatch):
    monkeypatch.setattr(server_body, "BODY_TIMEOUT_S", 0.2)
    api = OpenAIApi(Engine(), BlockingTokenizer(), "m", MAX_LEN, 5.0)

    async def go() -> None:
        async with TestServer(app_with(api)) as server:
            reader, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{"
            )
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
            assert head.startswith(b"HTTP/1.1 408")
            writer.close()

    asyncio.run(go())
    api.close()


def test_abort_all_ends_running_generations_in_error():
    engine = Engine(hold=True)
    api = OpenAIApi(engine, BlockingTokenizer(), "m", MAX_LEN, 5.0)
    api.tok.release.set()

    async def go() -> None:
        async with TestClient(TestServer(app_with(api))) as client:
            call = asyncio.ensure_future(
                client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 4, "n": 2})
            )
            for _ in range(int(WAIT_S / 0.01)):
                if api.live:
                    break
                await asyncio.sleep(0.01)
            assert api.live == 1 and api.abort_all() == 2
            resp = await asyncio.wait_for(call, WAIT_S)
            assert resp.status == 500 and "aborted" in (await resp.json())["error"]["message"]
            assert api.live == 0 and len(engine.aborted) == 2

    asyncio.run(go())
    api.close()
