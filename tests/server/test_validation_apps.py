"""Validation through real aiohttp apps in this process, over a fake engine (no model): the
worker API refuses every bad field, the JSON-body hazards are 400 on every endpoint, the error
middleware answers OpenAI-style (the parsers alone: test_validation.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.protocol.sampling import INT64_MAX
from tests.server.validation_app import (
    CHAT,
    HUGE,
    INF,
    NAN,
    SURROGATE,
    VOCAB,
    Call,
    FakeEngine,
    FakeTokenizer,
    exchange,
    make_app,
)


def gen(**kw: Any) -> dict[str, Any]:
    return {"request_id": "r1", "prompt_ids": [1, 2], "params": {"max_tokens": 4}, **kw}


BAD_GENERATE = [
    (gen(request_id=""), "request_id"),
    (gen(request_id="x" * 257), "request_id"),
    (gen(request_id="a\nb"), "request_id"),
    (gen(request_id=5), "request_id"),
    ({"prompt_ids": [1]}, "request_id"),
    (gen(prompt_ids="x"), "prompt_ids"),
    (gen(prompt_ids=[1, True]), "prompt_ids"),
    (gen(prompt_ids=[1, 2.0]), "prompt_ids"),
    (gen(prompt_ids=[10**30]), "prompt"),
    (gen(prompt_ids=[]), "prompt"),
    (gen(params={"seed": "x"}), "seed"),
    (gen(params={"seed": 2**64}), "seed"),
    (gen(params={"top_k": 2**63}), "top_k"),
    (gen(params={"stop_token_ids": [1180591620717411303424]}), "stop_token_ids"),
    (gen(params={"stop_token_ids": [VOCAB]}), "stop_token_ids"),
    (gen(params={"stop_token_ids": 5}), "stop_token_ids"),
    (gen(params={"temperature": NAN}), "temperature"),
    (gen(params={"temperature": HUGE}), "temperature"),
    (gen(params={"repetition_penalty": NAN}), "repetition_penalty"),
    (gen(params={"ignore_eos": "true"}), "ignore_eos"),
    (gen(params={"max_tokens": 1.5}), "max_tokens"),
    (gen(params={"max_tokens": 100}), "max_tokens"),
    (gen(params={"bogus": 1}), "params"),
    (gen(params=[1]), "params"),
    (gen(timeout_s=NAN), "timeout_s"),
    (gen(timeout_s=INF), "timeout_s"),
    (gen(timeout_s=0), "timeout_s"),
    (gen(timeout_s=-5), "timeout_s"),
    (gen(timeout_s=1e7), "timeout_s"),
    (gen(timeout_s="5"), "timeout_s"),
    (gen(prefill=[1]), "prefill"),
    (gen(prefill="tcp://host"), "prefill"),
    (gen(prefill=None), "prefill"),
    (gen(extra=1), "extra"),
    ([1], None),
]


def test_worker_generate_refuses_every_bad_field_and_serves_a_good_one() -> None:
    engine = FakeEngine()
    good = gen(timeout_s=5, prefill="tcp://[::1]:5555", params={"max_tokens": 4, "seed": -1})
    calls: list[Call] = [("POST", "/generate", b) for b, _ in BAD_GENERATE]
    calls += [("POST", "/generate", good)]
    calls += [("POST", "/abort", b) for b in ({"request_id": 5}, {"request_id": "x" * 300}, [1])]
    calls += [("POST", "/abort", b"["), ("POST", "/abort", {"request_id": "r9"})]
    results = exchange(make_app(engine), calls)
    for (body, param), (status, resp, _) in zip(BAD_GENERATE, results, strict=False):
        assert status == 400 and resp["error"]["param"] == param, (body, resp)
        assert resp["error"]["type"] == "invalid_request_error"
    status, text, _ = results[len(BAD_GENERATE)]
    assert status == 200 and json.loads(text.splitlines()[-1])["finish_reason"] == "length"
    [(rid, prompt, params, timeout, extra)] = engine.submitted
    assert (rid, prompt, params.seed, timeout) == ("r1", [1, 2], -1, 5.0)
    assert extra == {"prefill": "tcp://[::1]:5555"}
    abort_statuses = [s for s, _, _ in results[len(BAD_GENERATE) + 1 :]]
    assert abort_statuses == [400, 400, 400, 400, 200] and engine.aborted == ["r9"]


HAZARDS = [  # raw body, Content-Type, the param the 400 names
    (b"5", "application/json", None),
    (b"null", "application/json", None),
    (b'{"prompt": ' + b"[" * 100 + b"]" * 100 + b"}", "application/json", "prompt"),
    (b"[" * 100_000, "application/json", None),
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "application/json", None),
    (b'{"prompt": "x"}', "application/json; charset=no-such-charset", None),
    (b'{"prompt": "\xff\xfe"}', "application/json", None),
    (b'{"prompt": "a\\ud800"}', "application/json", "prompt"),
    (b'{"prompt": "x", "stop": ["\\udfff"]}', "application/json", "stop"),
    (b'{"prompt": "x", "temperature": NaN}', "application/json", "temperature"),
    (b'{"prompt": "x", "top_p": Infinity}', "application/json", "top_p"),
    (b'{"prompt": "x", "timeout": NaN}', "application/json", "timeout"),
    (b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", "application/json", "temperature"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_json_body_hazards_are_400_on_every_endpoint(path: str) -> None:
    for raw, ctype, param in HAZARDS:
        [(status, resp, _)] = exchange(make_app(), [("POST", path, raw)], ctype)
        assert status == 400 and resp["error"]["type"] == "invalid_request_error", (raw[:40], resp)
        if path == "/v1/completions":
            assert resp["error"]["param"] == param, (raw[:40], resp)


def test_openai_endpoints_serve_good_bodies_and_refuse_bad_ones() -> None:
    bodies: list[Call] = [
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 1e-40}),
        ("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 2, "seed": 7, "n": 2}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}),
        ("POST", "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"k": SURROGATE}}),
        ("POST", "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"self": 1}}),
        ("POST", "/v1/completions", {"prompt": "hi", "stop_token_ids": [VOCAB]}),
        # n choices of an int64 seed get seed + i: past int64, still a legal engine seed
        ("POST", "/v1/completions", {"prompt": ["a", "b"], "n": 3, "seed": INT64_MAX}),
    ]
    results = exchange(make_app(), bodies)
    assert [s for s, _, _ in results] == [200, 200, 400, 400, 400, 400, 200]
    assert results[1][1]["choices"][1]["message"]["content"] == "h"
    params = [r[1]["error"]["param"] for r in results[2:6]]
    assert params == ["messages", "chat_template_kwargs", "chat_template_kwargs", "stop_token_ids"]
    assert len(results[6][1]["choices"]) == 6


def test_chat_without_max_tokens_whose_min_tokens_cannot_fit_is_400() -> None:
    # max_tokens becomes the room left in the context (4 here), which min_tokens exceeds.
    long_chat = {"messages": [{"role": "user", "content": "x" * 60}], "min_tokens": 10}
    [(status, resp, _)] = exchange(make_app(), [("POST", "/v1/chat/completions", long_chat)])
    assert status == 400 and resp["error"]["param"] == "min_tokens", resp


@pytest.mark.parametrize(
    "error", [TypeError("unexpected keyword"), ValueError("chat template rejected it")]
)
def test_chat_template_failures_are_400(error: Exception) -> None:
    app = make_app(tok=FakeTokenizer(template_error=error))
    [(status, resp, _)] = exchange(app, [("POST", "/v1/chat/completions", CHAT)])
    assert status == 400 and resp["error"]["param"] == "messages", resp


def test_oversized_body_is_a_json_413() -> None:
    app = make_app(max_size=1024)
    calls: list[Call] = [(m, p, {"prompt": "x" * 2000}) for m, p in (
        ("POST", "/v1/completions"), ("POST", "/generate"))]  # fmt: skip
    for status, resp, _ in exchange(app, calls):
        assert status == 413 and resp["error"]["type"] == "invalid_request_error", resp
