"""A text prompt is bounded by its characters before it is tokenized (LESSONS #19), the
tokenizing has a deadline, and a client that leaves takes its queued tokenizing with it
(frontend/prompts.py).

Real aiohttp apps in this process over a fake engine, with a tokenizer that counts what it
was asked to encode, or blocks until released.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pdserve.frontend import prompts as openai_prompts
from pdserve.frontend.api import (
    BODY_BYTES_PER_TOKEN,
    MIN_BODY_BYTES,
    OpenAIApi,
    body_bound,
    prompt_char_bound,
    text_chars,
)
from pdserve.frontend.protocol import MAX_CHOICES
from pdserve.model.tokenizer import Tokenizer as RealTokenizer
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams, validate_prompt
from pdserve.server.body import MAX_BODY_BYTES, app_args
from pdserve.server.errors import error_middleware
from tests.frontend.fakes import Tokenizer, app_with

VOCAB, MAX_LEN = 100, 64
LIMIT = 200  # characters: the fake tokenizer's tokens are one character each
WAIT_S = 10.0


class Engine:
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_ids, params, VOCAB, MAX_LEN)

    def submit(self, rid: str, prompt: list[int], params: Any, sink: Any, timeout_s: Any = None,
               **extra: Any) -> None:  # fmt: skip
        sink(RequestOutput(rid, (7,), (), "length", None, len(prompt)))

    def abort(self, rid: str) -> None:
        pass


class CountingTokenizer(Tokenizer):
    """Records the length of every text it encodes; `gate`: encode waits until it is set."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.encoded: list[int] = []
        self.gate = gate
        self.entered = threading.Semaphore(0)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.entered.release()
        if self.gate is not None:
            assert self.gate.wait(WAIT_S), "the test never released the tokenizer"
        self.encoded.append(len(text))
        return super().encode(text, add_special_tokens)


def post(api: OpenAIApi, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async def go() -> tuple[int, dict[str, Any]]:
        async with TestClient(TestServer(app_with(api))) as client:
            r = await client.post(path, json=body)
            return r.status, await r.json()

    return asyncio.run(go())


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "a" * (LIMIT + 1), "max_tokens": 1}),
        ("/v1/completions", {"prompt": ["ab", "a" * (LIMIT + 1)], "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * (LIMIT + 1)}]}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a" * LIMIT}]}]},
        ),
    ],
)
def test_a_text_longer_than_the_context_can_hold_is_refused_untokenized(path, body):
    tok = CountingTokenizer()
    api = OpenAIApi(Engine(), tok, "m", MAX_LEN, 5.0, max_prompt_chars=LIMIT)
    status, answer = post(api, path, body)
    api.close()
    assert status == 400, answer
    err = answer["error"]
    assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"
    assert f"at most {LIMIT} characters" in err["message"]
    assert tok.encoded == []  # nothing was tokenized


def test_a_text_within_the_bound_is_tokenized_and_served():
    tok = CountingTokenizer()
    api = OpenAIApi(Engine(), tok, "m", MAX_LEN, 5.0, max_prompt_chars=LIMIT)
    status, answer = post(api, "/v1/completions", {"prompt": "abc", "max_tokens": 1})
    api.close()
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
    assert tok.encoded == [3]


def test_tokenizing_past_its_deadline_is_a_413(monkeypatch):
    monkeypatch.setattr(openai_prompts, "TOKENIZE_TIMEOUT_S", 0.2)
    gate = threading.Event()
    api = OpenAIApi(Engine(), CountingTokenizer(gate), "m", MAX_LEN, 5.0, max_prompt_chars=LIMIT)
    try:
        status, answer = post(api, "/v1/completions", {"prompt": "abc", "max_tokens": 1})
    finally:
        gate.set()
        api.close()
    assert status == 413 and answer["error"]["code"] == "prompt_too_large"


def test_a_client_that_leaves_takes_its_queued_tokenizing_with_it():
    """Every tokenizer thread busy; a fifth call queued behind them, whose client then leaves:
    once the threads are free, its text is never tokenized."""
    gate = threading.Event()
    tok = CountingTokenizer(gate)
    api = OpenAIApi(Engine(), tok, "m", MAX_LEN, 5.0, max_prompt_chars=LIMIT)

    async def go() -> None:
        async with TestClient(TestServer(app_with(api))) as client:
            busy = [
                asyncio.ensure_future(
                    client.post("/v1/completions", json={"prompt": "a" * (i + 1), "max_tokens": 1})
                )
                for i in range(openai_prompts.TOKENIZER_THREADS)
            ]
            for _ in busy:  # every thread is inside encode
                assert await asyncio.to_thread(tok.entered.acquire, True, WAIT_S)
            leaving = asyncio.ensure_future(
                client.post("/v1/completions", json={"prompt": "z" * 50, "max_tokens": 1})
            )
            pool = api.prompts.pool
            for _ in range(int(WAIT_S / 0.01)):
                if pool.queued() == 1:
                    break
                await asyncio.sleep(0.01)
            assert pool.queued() == 1  # its handler is waiting for a thread
            leaving.cancel()  # the client closes its connection
            await asyncio.sleep(0.2)  # the server sees it go
            gate.set()
            answers = await asyncio.wait_for(asyncio.gather(*busy), WAIT_S)
            assert [r.status for r in answers] == [200] * len(busy)
            await asyncio.sleep(0.2)
            assert sorted(tok.encoded) == list(range(1, len(busy) + 1))  # never the 50

    try:
        asyncio.run(go())
    finally:
        gate.set()
        api.close()


def test_the_longest_piece_bounds_every_tokens_text(tiny_dir):
    """Tokenizer.max_token_chars is an upper bound on the characters any one token stands for,
    so max_model_len x it is a text that may still fit, and a longer one cannot."""
    tok = RealTokenizer.from_dir(tiny_dir)
    texts = [tok.decode([i], skip_special_tokens=False) for i in range(tok.vocab_size)]
    assert tok.max_token_chars >= max(len(t) for t in texts)
    assert prompt_char_bound(tok.max_token_chars, 4096) == tok.max_token_chars * 4096


def test_text_chars_counts_string_values_only():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "abc"}]}, {"role": "x"}]
    assert text_chars(msgs) == len("user") + len("text") + len("abc") + len("x")


def test_the_body_bound_follows_the_context():
    assert body_bound(4096) == MAX_CHOICES * 4096 * BODY_BYTES_PER_TOKEN  # 16 MiB
    assert body_bound(16) == MIN_BODY_BYTES and body_bound(10**7) == MAX_BODY_BYTES


def test_a_body_larger_than_the_context_could_use_is_a_413_before_it_is_read():
    api = OpenAIApi(Engine(), CountingTokenizer(), "m", 16, 5.0, max_prompt_chars=LIMIT)
    app = web.Application(middlewares=[error_middleware()], **app_args(api.max_body_bytes))
    app.add_routes(api.routes())

    async def go() -> tuple[int, dict[str, Any]]:
        async with TestClient(TestServer(app)) as client:
            body = b'{"prompt": "' + b"a" * (MIN_BODY_BYTES + 1) + b'"}'
            r = await client.post("/v1/completions", data=body)
            return r.status, await r.json()

    status, answer = asyncio.run(go())
    api.close()
    assert status == 413 and answer["error"]["code"] == "body_too_large"
    assert f"({MIN_BODY_BYTES} bytes)" in answer["error"]["message"]
