"""Validation once, complete: every bad field is a 400 that names it, before an engine sees it.

The parsers are called directly; the worker API, the JSON-body hazards and the error
middleware run through real aiohttp apps in this process, over a fake engine (no model).
"""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pdserve.frontend.api import OpenAIApi
from pdserve.frontend.protocol import (
    ApiError,
    check_json,
    parse_chat,
    parse_completion,
    parse_json_body,
)
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import (
    INT64_MAX,
    SEED_MAX,
    SEED_MIN,
    InvalidParams,
    SamplingParams,
    validate_prompt,
)
from pdserve.server.errors import error_middleware
from pdserve.worker.api import WorkerApi, params_to_json
from pdserve.worker.generate_body import check_prefill_address, params_from_json

VOCAB, MAX_LEN = 100, 64
NAN, INF = float("nan"), float("inf")
HUGE = 10**400  # float(HUGE) raises OverflowError
SURROGATE = "a\ud800b"


def err(fn: Any, body: Any) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(body)
    assert e.value.status == 400
    return e.value


# -- the OpenAI parsers ----------------------------------------------------------------------
BAD_COMPLETION = [
    ({"temperature": HUGE}, "temperature"),
    ({"temperature": NAN}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"temperature": 100.5}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_p": NAN}, "top_p"),
    ({"min_p": NAN}, "min_p"),
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 2**64}, "top_k"),
    ({"top_k": 2**31}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"repetition_penalty": NAN}, "repetition_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 101}, "repetition_penalty"),
    ({"frequency_penalty": -INF}, "frequency_penalty"),
    ({"presence_penalty": HUGE}, "presence_penalty"),
    ({"seed": "x"}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"stop_token_ids": [1180591620717411303424]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"ignore_eos": "true"}, "ignore_eos"),
    ({"echo": "yes"}, "echo"),
    ({"stream": 1}, "stream"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"include_stop_str_in_output": 0}, "include_stop_str_in_output"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"stream_options": []}, "stream_options"),
    ({"timeout": NAN}, "timeout"),
    ({"timeout": INF}, "timeout"),
    ({"timeout": 0}, "timeout"),
    ({"timeout": -1}, "timeout"),
    ({"timeout": 1e6 + 1}, "timeout"),
    ({"timeout": HUGE}, "timeout"),
    ({"timeout": "10"}, "timeout"),
    ({"timeout": True}, "timeout"),
    ({"n": 17}, "n"),
    ({"n": 2**70}, "n"),
    ({"n": 16, "prompt": ["p"] * 17}, "n"),
    ({"prompt": ["p"] * 257}, "prompt"),
    ({"prompt": [[1]] * 257}, "prompt"),
    ({"stop": ["s"] * 17}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["a", ""]}, "stop"),
    ({"stop": "x" * 1001}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"max_tokens": 2**40}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": "1"}, "logprobs"),
    ({"model": 5}, "model"),
]


@pytest.mark.parametrize("fields,param", BAD_COMPLETION)
def test_completion_field_is_400_naming_it(fields: dict[str, Any], param: str) -> None:
    assert err(parse_completion, {"prompt": "x", **fields}).param == param


def test_completion_accepts_the_edges() -> None:
    spec = parse_completion(
        {
            "prompt": ["p"] * 16,
            "n": 16,
            "temperature": 1e-40,
            "top_k": -1,
            "seed": INT64_MAX,
            "stop": ["x" * 1000] * 16,
            "timeout": 1e6,
            "repetition_penalty": 100,
            "stop_token_ids": list(range(1024)),
        }
    )
    p = spec.params
    assert p.greedy and p.top_k == 0 and p.seed == INT64_MAX and spec.timeout_s == 1e6
    assert len(spec.prompts) * spec.n == 256 and len(p.stop_token_ids) == 1024
    assert parse_completion({"prompt": "x", "seed": -(2**63)}).params.seed == -(2**63)
    assert not parse_completion({"prompt": "x", "temperature": 1e-5}).params.greedy


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BAD_CHAT = [
    ({"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"bos_token": "<s>"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"not-a-name": 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"": 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"add_generation_prompt": "no"}, "add_generation_prompt"),
    ({"messages": [{"role": "x" * 10_000, "content": "hi"}]}, "messages"),
    ({"temperature": NAN}, "temperature"),
    ({"n": 17}, "n"),
    ({"timeout": -INF}, "timeout"),
]


@pytest.mark.parametrize("fields,param", BAD_CHAT)
def test_chat_field_is_400_naming_it(fields: dict[str, Any], param: str) -> None:
    e = err(parse_chat, {**CHAT, **fields})
    assert e.param == param and len(e.message) < 400


def test_chat_template_kwargs_pass_through() -> None:
    spec = parse_chat({**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert spec.chat_kwargs == {"add_generation_prompt": True, "enable_thinking": False}


HOSTILE = [None, "x", "", [], {}, [[1]], ["a"], True, NAN, INF, -INF, HUGE, -HUGE, 2**64, 1e308]
HOSTILE += [-1, 0, 1.5, [2**64], [HUGE], [-1], 10**4000]


@pytest.mark.parametrize("parse", [parse_completion, parse_chat])
def test_parsers_raise_only_api_errors(parse: Any) -> None:
    keys = ["prompt", "messages", "model", "n", "stop", "stream_options", "timeout", "top_k"]
    keys += ["temperature", "seed", "stop_token_ids", "max_tokens", "logprobs", "top_logprobs"]
    keys += ["chat_template_kwargs", "echo", "min_tokens", "repetition_penalty"]
    for key in keys:
        for v in HOSTILE:
            try:
                parse({"prompt": "x", **CHAT, key: v})
            except ApiError as e:
                assert e.status == 400 and len(e.message) < 600, (key, v)


# -- SamplingParams, validate_prompt, params_from_json ----------------------------------------
def test_sampling_params_bounds() -> None:
    assert SamplingParams(temperature=1e-40).greedy
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=1e-5).greedy
    for seed in (SEED_MIN, SEED_MAX, INT64_MAX + 255):  # n choices of an int64 seed: seed + i
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)  # type: ignore[arg-type]
    for kw in ({"seed": SEED_MAX + 1}, {"seed": "x"}, {"top_k": 2**31}, {"ignore_eos": 1}):
        with pytest.raises(InvalidParams) as e:
            SamplingParams(**kw)  # type: ignore[arg-type]
        assert e.value.param == next(iter(kw))
    with pytest.raises(InvalidParams, match=r"must be a finite number in \[0, 100\], got nan"):
        SamplingParams(temperature=NAN)
    with pytest.raises(InvalidParams, match="got an integer of 1329 bits"):
        SamplingParams(repetition_penalty=HUGE)


def test_validate_prompt_checks_stop_token_ids_against_the_vocab() -> None:
    validate_prompt([1], SamplingParams(stop_token_ids=(VOCAB - 1,)), VOCAB, MAX_LEN)
    with pytest.raises(InvalidParams) as e:
        validate_prompt([1], SamplingParams(stop_token_ids=(3, VOCAB)), VOCAB, MAX_LEN)
    assert e.value.param == "stop_token_ids" and str(e.value) == (
        f"stop_token_ids must be in [0, {VOCAB}), got {VOCAB}"
    )


def test_params_from_json_raises_only_api_errors_and_what_it_returns_is_usable() -> None:
    accepted = 0
    for name in SamplingParams.__struct_fields__:
        for v in HOSTILE:
            try:
                p = params_from_json({name: v})
            except ApiError as e:
                assert e.status == 400 and e.param in (name, "params"), (name, v, e.param)
                continue
            accepted += 1
            msgspec.msgpack.encode(params_to_json(p))  # what a PrefillRequest carries
            torch.tensor([p.top_k, p.max_tokens, *p.stop_token_ids])
            if p.seed is not None:
                torch.Generator().manual_seed(p.seed)
    assert accepted >= 10  # the legal values among HOSTILE did get through
    for bad in ([1], "x", None, {"nope": 1}, {1: 2}):
        assert err(params_from_json, bad).param == "params"


@pytest.mark.parametrize(
    "address,ok",
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://worker-3.cluster.local:65535", True),
        ("tcp://[::1]:1", True),
        ("tcp://[fe80::1%eth0]:1", False),
        ("tcp://[zz::1]:1", False),
        ("tcp://[1::2::3]:1", False),
        ("tcp://[::ffff:10.0.0.1]:7", True),
        ("tcp://host:0", False),
        ("tcp://host:65536", False),
        ("tcp://host", False),
        ("http://host:1", False),
        ("tcp://a b:1", False),
        ("tcp://-a:1", False),
        ("tcp://" + "a." * 140 + "b:1", False),
        ("tcp://host:1\n", False),
        ([1], False),
        (None, False),
    ],
)
def test_prefill_address(address: Any, ok: bool) -> None:
    if ok:
        assert check_prefill_address(address) == address
    else:
        assert err(check_prefill_address, address).param == "prefill"


# -- the JSON body --------------------------------------------------------------------------
def test_json_body_checks() -> None:
    check_json(json.loads("[" * 64 + "]" * 64))
    assert [parse_json_body(raw, None) for raw in (b"5", b"null", b'"s"')] == [5, None, "s"]
    assert err(check_json, json.loads('{"prompt": ' + "[" * 64 + "]" * 64 + "}")).param == "prompt"
    assert err(check_json, {"messages": [{"content": SURROGATE}]}).param == "messages"
    assert err(check_json, {"x": {SURROGATE: 1}}).param == "x"
    assert parse_json_body(b'{"p": "\\u00e9\\ud83d\\ude00"}', None) == {"p": "é😀"}
    assert math.isnan(parse_json_body(b'{"t": NaN}', "utf-8")["t"])  # the fields refuse it
    for raw, charset, words in [
        (b"[" * 100_000, None, "nests deeper"),
        (b'{"n": ' + b"9" * 5000 + b"}", None, "not valid JSON"),
        (b'{"p": "\xff"}', None, "not valid JSON"),
        (b"{}", "no-such-charset", "unsupported charset"),
        (b"{}", "hex", "unsupported charset"),
        (b'{"p": "\\ud800"}', None, "lone surrogate"),
        (b"", None, "not valid JSON"),
    ]:
        with pytest.raises(ApiError) as e:
            parse_json_body(raw, charset)
        assert e.value.status == 400 and words in e.value.message, (raw[:20], e.value.message)


# -- real apps --------------------------------------------------------------------------------
class FakeEngine:
    """validate/submit/abort, max_model_len, vocab_size, cfg: what WorkerApi uses."""

    vocab_size, max_model_len = VOCAB, MAX_LEN
    cfg = SimpleNamespace(request_timeout_s=5.0)

    def __init__(self) -> None:
        self.submitted: list[tuple[Any, ...]] = []
        self.aborted: list[str] = []

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_ids, params, VOCAB, MAX_LEN)

    def submit(self, rid: str, prompt: list[int], params: Any, sink: Any, timeout_s: Any = None,
               **extra: Any) -> None:  # fmt: skip
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
