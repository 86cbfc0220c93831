"""What the validation tests share: the hostile values, a fake engine and tokenizer (no
model), and a real aiohttp app with the OpenAI and worker routes over them, exchanged with in
this process."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pdserve.frontend.api import OpenAIApi
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams, validate_prompt
from pdserve.server.errors import error_middleware
from pdserve.worker.http.api import WorkerApi

VOCAB, MAX_LEN = 100, 64
NAN, INF = float("nan"), float("inf")
HUGE = 10**400  # float(HUGE) raises OverflowError
SURROGATE = "a\ud800b"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


class FakeEngine:
    """validate/submit/abort, max_model_len, vocab_size, cfg: what the APIs use. `submit`
    validates first, as an engine's does (the worker API leaves the engine's check to it)."""

    vocab_size, max_model_len = VOCAB, MAX_LEN
    cfg = SimpleNamespace(request_timeout_s=5.0)

    def __init__(self) -> None:
        self.submitted: list[tuple[Any, ...]] = []
        self.aborted: list[str] = []

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_ids, params, VOCAB, MAX_LEN)

    def submit(self, rid: str, prompt: list[int], params: Any, sink: Any, timeout_s: Any = None,
               **extra: Any) -> None:  # fmt: skip
        self.validate(prompt, params)
        self.submitted.append((rid, prompt, params, timeout_s, extra))
        sink(RequestOutput(rid, (7,), (), "length", None, len(prompt)))

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


class FakeTokenizer:
    def __init__(self, template_error: Exception | None = None) -> None:
        self.template_error = template_error

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        if self.template_error is not None:
            raise self.template_error
        return "".join(m["content"] for m in messages)

    def incremental(self, skip_special_tokens: bool = True) -> Any:
        return SimpleNamespace(push=lambda t: chr(97 + t % 26), flush=lambda: "")


def make_app(
    engine: FakeEngine | None = None, tok: FakeTokenizer | None = None, max_size: int = 2**20
) -> web.Application:
    engine = engine or FakeEngine()
    app = web.Application(client_max_size=max_size, middlewares=[error_middleware()])
    app.add_routes(OpenAIApi(engine, tok or FakeTokenizer(), "m", MAX_LEN, 5.0).routes())
    app.add_routes(WorkerApi(engine, "decode", "m", {}).routes())
    return app


Call = tuple[str, str, Any]  # method, path, body (bytes as is, anything else as JSON)


def exchange(app: web.Application, calls: list[Call], ctype: str = "application/json") -> list:
    """(status, parsed JSON body or text, headers) per call, in one server."""

    async def go() -> list[tuple[int, Any, Any]]:
        out = []
        async with TestClient(TestServer(app)) as client:
            for method, path, body in calls:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                r = await client.request(method, path, data=data, headers={"Content-Type": ctype})
                text = await r.text()
                parsed = json.loads(text) if r.content_type == "application/json" else text
                out.append((r.status, parsed, r.headers))
        return out

    return asyncio.run(go())
