"""A tokenizer whose token i is the letter chr(97 + i % 26), a scripted engine, and an app around
an OpenAIApi with calls to it in this process."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pdserve.frontend.api import OpenAIApi
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import validate_prompt
from pdserve.server.errors import error_middleware


class Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [(ord(c) - 97) % 26 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self.decode([token_id]).encode()

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        return "".join(m["content"] for m in messages)

    def incremental(self, skip_special_tokens: bool = True) -> Any:
        return SimpleNamespace(push=lambda t: chr(97 + t % 26), flush=lambda: "")


def app_with(api: OpenAIApi) -> web.Application:
    app = web.Application(middlewares=[error_middleware()])
    app.add_routes(api.routes())
    return app


class Scripted:
    """A fake engine: checks prompts as a model of `vocab` ids and `max_len` positions would,
    keeps what it was sent, and answers each request with `outputs(prompt, params)`: the
    RequestOutputs it then emits, in order (default: one token, 0, and the end)."""

    def __init__(self, vocab: int, max_len: int, outputs: Any = None) -> None:
        self.vocab, self.max_len = vocab, max_len
        self.outputs = outputs
        self.prompts: list[list[int]] = []
        self.params: list[Any] = []

    def validate(self, prompt_ids: list[int], params: Any) -> None:
        validate_prompt(prompt_ids, params, self.vocab, self.max_len)

    def submit(self, rid: str, prompt: list[int], params: Any, sink: Any,
               timeout_s: Any = None, **extra: Any) -> None:  # fmt: skip
        self.prompts.append(list(prompt))
        self.params.append(params)
        if self.outputs is None:
            sink(RequestOutput(rid, (0,), (), "length", None, len(prompt)))
            return
        for out in self.outputs(prompt, params):
            sink(RequestOutput(rid, *out))

    def abort(self, rid: str) -> None:
        pass


def call(api: OpenAIApi, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One request to an app around `api` in this process: (status, parsed JSON body)."""

    async def go() -> tuple[int, Any]:
        async with TestClient(TestServer(app_with(api))) as client:
            r = await client.request(method, path, json=body)
            return r.status, await r.json()

    return asyncio.run(go())


def stream(api: OpenAIApi, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed request's chunks (the JSON of each `data:` event before [DONE])."""

    async def go() -> str:
        async with TestClient(TestServer(app_with(api))) as client:
            r = await client.post(path, json={**body, "stream": True})
            assert r.status == 200, await r.text()
            return await r.text()

    events = [e[6:] for e in asyncio.run(go()).split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]
