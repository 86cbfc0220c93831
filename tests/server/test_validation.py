"""Validation once, complete: every bad field is a 400 that names it, before an engine sees it.

The parsers are called directly (the same checks through real apps: test_validation_apps.py).
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import pytest
import torch

from pdserve.frontend.protocol import (
    ApiError,
    check_json,
    parse_chat,
    parse_completion,
    parse_json_body,
)
from pdserve.protocol.generate import check_prefill, decode_generate
from pdserve.protocol.sampling import (
    INT64_MAX,
    SEED_MAX,
    SEED_MIN,
    InvalidParams,
    SamplingParams,
    validate_prompt,
)
from pdserve.server.json_body import utf8_body
from tests.server.validation_app import CHAT, HUGE, INF, MAX_LEN, NAN, SURROGATE, VOCAB


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


# -- SamplingParams, validate_prompt, from_builtins, the prefill address --------------------
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


def test_from_builtins_raises_only_invalid_params_and_what_it_returns_is_usable() -> None:
    """A peer's params (PrefillRequest): InvalidParams, which every API answers as a 400 naming
    the field, and nothing else."""
    accepted = 0
    for name in SamplingParams.__struct_fields__:
        for v in HOSTILE:
            try:
                p = SamplingParams.from_builtins({name: v})
            except InvalidParams as e:
                assert e.param in (name, "params"), (name, v, e.param)
                continue
            accepted += 1
            msgspec.msgpack.encode(p.to_builtins())  # what a PrefillRequest carries
            torch.tensor([p.top_k, p.max_tokens, *p.stop_token_ids])
            if p.seed is not None:
                torch.Generator().manual_seed(p.seed)
    assert accepted >= 10  # the legal values among HOSTILE did get through
    for bad in ([1], "x", None, {"nope": 1}, {1: 2}):
        with pytest.raises(InvalidParams) as e:
            SamplingParams.from_builtins(bad)
        assert e.value.param == "params"


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
        assert check_prefill(address) == address
    else:
        with pytest.raises(InvalidParams) as e:
            check_prefill(address)
        assert e.value.param == "prefill"


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


def test_a_generate_body_in_any_charset_python_reads_decodes_as_in_utf8() -> None:
    text = json.dumps({"request_id": "é-1", "prompt_ids": [1]}, ensure_ascii=False)
    for name in ("utf-8", "UTF-8", "utf8", "U8"):  # UTF-8 by any name: the bytes as they came
        raw = text.encode()
        assert utf8_body(raw, name) is raw
    assert utf8_body(text.encode(), None) == text.encode()
    for charset in ("latin-1", "utf-16", "utf-8-sig", "cp1252"):
        raw = text.encode(charset)
        assert decode_generate(utf8_body(raw, charset)).request_id == "é-1", charset
    for raw, charset, words in [
        (b"{}", "no-such-charset", "unsupported charset"),
        (b"{}", "hex", "unsupported charset"),
        (b"{}", "rot13", "unsupported charset"),
        (b"\x00\xd8", "utf-16-le", "not valid JSON in 'utf-16-le'"),
        (b'{"request_id": "+2AA-"}', "utf-7", "lone surrogate (U+D800)"),
    ]:
        with pytest.raises(ApiError) as e:
            utf8_body(raw, charset)
        assert e.value.status == 400 and words in e.value.message, (charset, e.value.message)
