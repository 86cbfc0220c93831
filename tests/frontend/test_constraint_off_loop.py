"""Output constraints compile off the event loop (frontend/constraint_threads.py): while one
request's constraint compiles slowly, the same server answers other requests (the front end's
completions, chat and forced tool calls; a worker's /generate); no compile is ever called from
a thread running an event loop; and a constraint that does not compile, or not in time, is
still a 400 whose OpenAI-style body names the field the client sent.

Real aiohttp apps in this process (TestServer: 127.0.0.1, a free port) over scripted engines.
The compile step is made slow by a gate: a spec holding the test's mark waits, on the grammar
thread, until the test opens it (at most GATE_S, always opened at the end)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

import pdserve.frontend.constraint_threads as constraint_threads
import pdserve.protocol.constraint as constraint
from pdserve.config import FrontendConfig
from pdserve.frontend.api import OpenAIApi
from pdserve.protocol.constraint import Constraint, ConstraintKind, ToLark
from pdserve.protocol.grammar_thread import GRAMMAR_THREAD
from pdserve.server.errors import error_middleware
from pdserve.worker.http.api import WorkerApi
from tests.frontend.fakes import Scripted, Tokenizer, app_with
from tests.frontend.tool_models import hermes, tokenizer, writer

GATE_S = 8.0  # the longest a gated compile waits (under the grammar thread's 10 s bound)
WAIT_S = 15.0  # the longest the test waits for anything
OTHER = {"prompt": "abc", "max_tokens": 1}  # a request with no constraint
K = ConstraintKind


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class SlowCompiles:
    """The compile step patched: a spec holding `mark` waits for `release` (on the grammar
    thread, where protocol/constraint.py `_compile_error` runs), then compiles as ever.
    `on_loop` records, for every compile asked for, whether its caller ran an event loop."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mark = f"slowmark{uuid.uuid4().hex}"  # a new spec: no cached result
        self.entered = threading.Event()
        self.release = threading.Event()
        self.done = threading.Event()  # the slow compile returned
        self.on_loop: list[bool] = []
        inner, outer = constraint._compile_error, constraint.compile_error

        def gated(kind: ConstraintKind, spec: str, *to_lark: ToLark) -> str | None:
            if self.mark in spec:
                self.entered.set()
                self.release.wait(GATE_S)
                self.done.set()
            return inner(kind, spec, *to_lark)

        def watched(kind: ConstraintKind, spec: str, *to_lark: ToLark) -> str | None:
            self.on_loop.append(_on_loop())
            return outer(kind, spec, *to_lark)

        monkeypatch.setattr(constraint, "_compile_error", gated)
        monkeypatch.setattr(constraint, "compile_error", watched)

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, WAIT_S), "the slow compile never began"


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> Iterator[SlowCompiles]:
    s = SlowCompiles(monkeypatch)
    try:
        yield s
    finally:
        s.release.set()  # a failed test leaves no thread waiting on the gate


async def while_compiling(
    client: TestClient, slow: SlowCompiles, method: str, path: str, body: Any, others: Any
) -> tuple[bool, list[int], int, Any]:
    """Send the slow request; once its compile began, `others(client)` (its statuses); then
    open the gate. (whether the others were answered before the compile ended, their
    statuses, the slow one's status and JSON or text)."""
    slow_one = asyncio.create_task(client.request(method, path, json=body))
    try:
        await slow.wait_entered()
        async with asyncio.timeout(WAIT_S):
            statuses = await others(client)
        first = not slow.done.is_set()
        slow.release.set()
        async with asyncio.timeout(WAIT_S):
            r = await slow_one
            answer = await (r.json() if r.content_type == "application/json" else r.text())
        return first, statuses, r.status, answer
    finally:
        slow_one.cancel()


async def front_end_others(client: TestClient) -> list[int]:
    other = await client.post("/v1/completions", json=OTHER)
    models = await client.get("/v1/models")
    return [other.status, models.status]


def serve(app: web.Application, test: Any) -> Any:
    async def go() -> Any:
        async with TestClient(TestServer(app)) as client:
            return await test(client)

    return asyncio.run(go())


# -- the front end -------------------------------------------------------------------------
def cases(mark: str) -> dict[str, tuple[str, dict[str, Any], ConstraintKind]]:
    """(path, body, the kind the engine gets) of each way a request asks for a constraint."""
    schema = {"type": "object", "properties": {mark: {"type": "string"}}}
    chat = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    rf = {"type": "json_schema", "json_schema": {"schema": schema}}
    return {
        "completion": ("/v1/completions", {"prompt": "x", "guided_regex": mark}, K.REGEX),
        "chat": ("/v1/chat/completions", {"messages": chat, "response_format": rf}, K.JSON_SCHEMA),
        "tool_call": (
            "/v1/chat/completions",
            {"messages": chat, "tools": [tool], "tool_choice": "required"},
            K.GRAMMAR,
        ),
    }


@pytest.mark.parametrize("case", ["completion", "chat", "tool_call"])
def test_the_front_end_answers_others_while_a_constraint_compiles(slow, case):
    path, body, kind = cases(slow.mark)[case]
    if case == "tool_call":  # a template that shows the call format, an engine that calls
        tok: Any = tokenizer()
        engine = writer(tok, hermes(("f", {slow.mark: "x"})))
    else:
        tok, engine = Tokenizer(), Scripted(26, 4096)
    api = OpenAIApi(engine, tok, "m", 4096, 5.0, None, FrontendConfig())
    try:
        first, others, status, answer = serve(
            app_with(api),
            lambda client: while_compiling(client, slow, "POST", path, body, front_end_others),
        )
    finally:
        api.close()
    assert first and others == [200, 200]  # answered before the slow compile had ended
    assert status == 200, answer
    constrained = [p.constraint for p in engine.params if p.constraint is not None]
    assert len(constrained) == 1 and constrained[0].kind is kind
    assert slow.mark in constrained[0].spec
    assert slow.on_loop and not any(slow.on_loop)  # every compile was asked for off the loop


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"prompt": "x", "guided_regex": "(a"}, "guided_regex", "'guided_regex': regex does not "
         "compile: "),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}},
         "response_format.json_schema.schema", "json_schema does not compile: Invalid type"),
        ({"prompt": "x", "structured_outputs": {"grammar": "start: nothing"}},
         "structured_outputs.grammar", "unknown name"),
    ],
)  # fmt: skip
def test_a_spec_that_does_not_compile_is_a_400_naming_its_field(body, param, words):
    engine = Scripted(26, 4096)
    api = OpenAIApi(engine, Tokenizer(), "m", 4096, 5.0)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"

    async def test(client: TestClient) -> tuple[int, Any]:
        r = await client.post(path, json=body)
        return r.status, await r.json()

    try:
        status, answer = serve(app_with(api), test)
    finally:
        api.close()
    assert status == 400, answer
    error = answer["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, None)
    assert words in error["message"], error
    assert engine.prompts == []


@pytest.mark.parametrize("bound", ["compile", "wait"])
def test_a_compile_not_done_in_time_is_a_400_naming_its_field(slow, monkeypatch, bound):
    """Past the grammar thread's bound the spec is refused as not compiling (and remembered);
    past the constraint threads' bound, as not compiled, the compiler being busy."""
    if bound == "compile":
        monkeypatch.setattr(GRAMMAR_THREAD, "timeout_s", 0.3)
        words = "'guided_regex': regex does not compile: it did not compile within 0.3s"
    else:
        monkeypatch.setattr(constraint_threads, "CHECK_TIMEOUT_S", 0.3)
        words = "'guided_regex': the constraint was not compiled within 0.3s"
    engine = Scripted(26, 4096)
    api = OpenAIApi(engine, Tokenizer(), "m", 4096, 5.0)

    async def test(client: TestClient) -> tuple[int, Any]:
        r = await client.post("/v1/completions", json={"prompt": "x", "guided_regex": slow.mark})
        return r.status, await r.json()

    try:
        status, answer = serve(app_with(api), test)
    finally:
        slow.release.set()
        api.close()
    assert status == 400 and answer["error"]["param"] == "guided_regex", answer
    assert answer["error"]["message"].startswith(words), answer
    assert engine.prompts == []


# -- a worker's /generate ------------------------------------------------------------------
def worker_app() -> tuple[WorkerApi, Scripted, web.Application]:
    engine = Scripted(26, 4096)
    fake: Any = engine
    fake.cfg = SimpleNamespace(request_timeout_s=30.0)
    fake.max_model_len, fake.vocab_size = 4096, 26
    api = WorkerApi(engine, "colocated", "m", {})
    app = web.Application(middlewares=[error_middleware()])
    app.add_routes(api.routes())
    return api, engine, app


async def worker_others(client: TestClient) -> list[int]:
    plain = {"request_id": "plain", "prompt_ids": [1, 2], "params": {"max_tokens": 1}}
    other = await client.post("/generate", json=plain)
    await other.read()  # the whole NDJSON stream, to its last line
    info = await client.get("/info")
    return [other.status, info.status]


def test_a_worker_answers_others_while_a_generate_constraint_compiles(slow):
    api, engine, app = worker_app()
    c = {"kind": "regex", "spec": slow.mark}
    body = {"request_id": "slow", "prompt_ids": [1, 2], "params": {"constraint": c}}
    try:
        first, others, status, answer = serve(
            app,
            lambda client: while_compiling(client, slow, "POST", "/generate", body, worker_others),
        )
    finally:
        api.constraints.close()
    assert first and others == [200, 200]  # answered before the slow compile had ended
    assert status == 200 and '"finish_reason":"length"' in answer, answer
    assert [p.constraint for p in engine.params] == [None, Constraint.from_builtins(c)]
    assert slow.on_loop and not any(slow.on_loop)


@pytest.mark.parametrize(
    "constraint_,words",
    [
        ({"kind": "regex", "spec": "(a"}, "regex does not compile"),
        ({"kind": "json_schema", "spec": '{"type": "objectx"}'}, "does not compile: Invalid type"),
    ],
)
def test_a_generate_constraint_that_does_not_compile_is_a_400(constraint_, words):
    api, engine, app = worker_app()
    body = {"request_id": "r", "prompt_ids": [1], "params": {"constraint": constraint_}}

    async def test(client: TestClient) -> tuple[int, Any]:
        r = await client.post("/generate", json=body)
        return r.status, await r.json()

    try:
        status, answer = serve(app, test)
    finally:
        api.constraints.close()
    assert status == 400 and answer["error"]["param"] == "constraint", answer
    assert words in answer["error"]["message"] and engine.prompts == []
