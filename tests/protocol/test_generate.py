"""The /generate body's one wire form (protocol/generate.py): what the router writes decodes to
itself; every refusal is InvalidParams naming a field that is wrong; and on every hostile body
(each field swapped for each hostile value, random mutations) the decoder accepts exactly what
the rules below accept, written out plainly (Python's json and a check per field), and names
a field those rules find wrong."""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import pytest

from pdserve.protocol.generate import (
    Generate,
    check_prefill,
    check_request_id,
    check_timeout,
    decode_generate,
    encode_generate,
)
from pdserve.protocol.sampling import InvalidParams, SamplingParams, is_int

GOOD = [
    Generate(request_id="r1", prompt_ids=[1, 2, 3]),
    Generate(request_id="r1", prompt_ids=[1], params=SamplingParams(max_tokens=7, seed=-3)),
    Generate(
        request_id="é" * 256,
        prompt_ids=list(range(4000)),
        params=SamplingParams(
            temperature=0, stop_token_ids=(5, 6), logit_bias=((3, 1.5), (9, -100.0)), logprobs=2
        ),
        timeout_s=0.25,
        prefill="tcp://[::1]:5555",
        channel="router-7",
    ),
    Generate(
        request_id="x",
        prompt_ids=[0],
        params=SamplingParams(prompt_logprobs=1, max_tokens=0),
        timeout_s=1e6,
        prefill="tcp://prefill-0.cluster.local:65535",
    ),
    Generate(request_id="x", prompt_ids=[2**64], channel="c" * 256),  # the engine checks ids
]


def answer(raw: bytes) -> Generate | tuple[str, str | None]:
    try:
        return decode_generate(raw)
    except InvalidParams as e:
        return str(e), e.param


def test_what_the_router_writes_decodes_to_itself() -> None:
    for g in GOOD:
        raw = encode_generate(g)
        assert decode_generate(raw) == g
        sent = json.loads(raw)
        for name in ("prefill", "channel"):  # absent when unused: a null would be refused
            assert (name in sent) == isinstance(getattr(g, name), str), (name, sent)


# -- the rules, written out: the faulty fields of a body as Python's json reads it -------------
FIELDS = ("request_id", "prompt_ids", "params", "timeout_s", "prefill", "channel")


def lone_surrogate(v: Any) -> bool:
    if isinstance(v, str):
        return not v.isascii() and any(0xD800 <= ord(c) <= 0xDFFF for c in v)
    if isinstance(v, list):
        return any(lone_surrogate(x) for x in v)
    if isinstance(v, dict):
        return any(lone_surrogate(k) or lone_surrogate(x) for k, x in v.items())
    return False


def param_faults(p: Any) -> set[str]:
    """None if the params are good, else the whole's fault and each entry's own (the decoder
    may meet either first: a type, or a pair such as min_tokens past max_tokens)."""
    try:
        SamplingParams.from_builtins(p)
        return set()
    except InvalidParams as e:
        found = {e.param or "params"}
    for k, v in p.items() if isinstance(p, dict) else ():
        try:
            SamplingParams.from_builtins({k: v})
        except InvalidParams as e:
            found.add(e.param or "params")
    return found


def faults(body: Any) -> set[str | None]:
    """Every field the rules find wrong in `body` (None: the body itself); empty if good."""
    if not isinstance(body, dict):
        return {None}
    found: set[str | None] = {k for k in body if k not in FIELDS}
    found |= {k for k, v in body.items() if lone_surrogate(v) or lone_surrogate(k)}
    checks = {
        "request_id": lambda v: check_request_id(v),
        "timeout_s": lambda v: check_timeout(v, "timeout_s"),
        "prefill": check_prefill,
        "channel": lambda v: check_request_id(v, "channel"),
    }
    for name, check in checks.items():
        if name in body or name == "request_id":
            try:
                check(body.get(name))
            except InvalidParams:
                found.add(name)
    ids = body.get("prompt_ids")
    if not (isinstance(ids, list) and all(is_int(t) for t in ids)):
        found.add("prompt_ids")
    found |= param_faults(body.get("params", {}))
    return found


def expected(body: dict[str, Any]) -> Generate:
    """A body the rules accept, as the decoder must give it."""
    return Generate(
        request_id=body["request_id"],
        prompt_ids=body["prompt_ids"],
        params=SamplingParams.from_builtins(body.get("params", {})),
        timeout_s=check_timeout(body.get("timeout_s"), "timeout_s"),
        prefill=body.get("prefill", msgspec.UNSET),
        channel=body.get("channel", msgspec.UNSET),
    )


def check_agrees(body: Any) -> bool:
    """The decoder's answer on `body` (written as Python's json writes it: NaN included) is the
    rules'; True if it was a refusal."""
    raw = json.dumps(body).encode()
    got = answer(raw)
    wrong = faults(body)
    if not wrong:
        assert got == expected(body), (body, got)
        return False
    assert isinstance(got, tuple), (body, got)
    message, param = got
    assert param in wrong, (body, got, wrong)
    assert 0 < len(message) < 600
    return True


def body(**kw: Any) -> dict[str, Any]:
    return {"request_id": "r1", "prompt_ids": [1, 2, 3], **kw}


GOOD_BODIES = [json.loads(encode_generate(g)) for g in GOOD] + [
    body(),
    body(params={}),
    body(timeout_s=5),
    body(timeout_s=None),
    body(params={"logit_bias": [[3, 1.5], [9, -100]], "top_k": 1, "temperature": 0}),
]
# Values that any field may be swapped for: every JSON type, edges, and what Python's json
# takes that JSON does not (NaN, Infinity), huge ints and lone surrogates.
HOSTILE = [
    None, True, False, 0, -1, 1, 2.0, 1.5, 10**30, 2**63, 2**64, -(2**63) - 1, float("nan"),
    float("inf"), -float("inf"), "", "x", "a\nb", "é", "a\ud800b", "\udc00", "tcp://h:1", [],
    [1], [True], [1.0], [[1]], [float("nan")], {}, {"max_tokens": 1}, {"bogus": 1},
    {"seed": "1"}, {"min_tokens": 9, "max_tokens": 2}, "x" * 300,
]  # fmt: skip
PARAM_NAMES = ["max_tokens", "seed", "top_k", "temperature", "stop_token_ids", "logit_bias",
               "min_tokens", "prompt_logprobs", "bogus"]  # fmt: skip


def test_good_bodies_decode_as_the_rules_read_them() -> None:
    for b in GOOD_BODIES:
        assert not faults(b), b
        assert not check_agrees(b)


def test_every_field_swapped_for_every_hostile_value_agrees_with_the_rules() -> None:
    refused = taken = 0
    for field in [*FIELDS, "extra"]:
        for value in HOSTILE:
            for b in (body(**{field: value}), {**body(), field: value, "channel": "c"}):
                if check_agrees(b):
                    refused += 1
                else:
                    taken += 1
    assert refused > 300 and taken > 10  # both kinds occur, so the comparison means something


def test_random_mutations_of_good_bodies_agree_with_the_rules() -> None:
    rng = random.Random(13)
    kinds = {"taken": 0, "refused": 0}
    for _ in range(2000):
        b = dict(rng.choice(GOOD_BODIES))
        for _ in range(rng.randint(1, 3)):
            field = rng.choice([*FIELDS, "extra"])
            if rng.random() < 0.2:
                b.pop(field, None)
            elif field == "params":
                p = dict(b.get("params") or {})
                p[rng.choice(PARAM_NAMES)] = rng.choice(HOSTILE)
                b["params"] = p
            elif field == "prompt_ids" and isinstance(b.get("prompt_ids"), list):
                ids = list(b["prompt_ids"]) or [0]
                ids[rng.randrange(len(ids))] = rng.choice([0, -1, True, 1.0, 2**64, "1", None])
                b["prompt_ids"] = ids
            else:
                b[field] = rng.choice(HOSTILE)
        kinds["refused" if check_agrees(b) else "taken"] += 1
    assert kinds["taken"] > 100 and kinds["refused"] > 500, kinds


# -- what JSON cannot say, and what msgspec says about it -------------------------------------
@pytest.mark.parametrize(
    "raw,words,param",
    [
        (b'{"request_id": "a\\ud800", "prompt_ids": [1]}', "lone UTF-16 surrogate", "request_id"),
        (b'{"prompt_ids": [1], "request_id": "a\\ud800"}', "lone UTF-16 surrogate", "request_id"),
        (b'{"request_id": "a", "prompt_ids": [1], "channel": "\\udc00"}', "surrogate", "channel"),
        (b'{"request_id": "\xff", "prompt_ids": [1]}', "Invalid UTF-8", None),
        (b'\xef\xbb\xbf{"request_id": "a", "prompt_ids": [1]}', "not valid JSON", None),
        (b'{"request_id": "a", "prompt_ids": [1]} x', "trailing characters", None),
        (b'{"request_id": "a", "prompt_ids": [1], "timeout_s": NaN}', "NaN is not", "timeout_s"),
        (b'{"request_id": "a", "prompt_ids": [1], "params": {"top_p": -Infinity}}',
         "-Infinity is not a JSON number", "top_p"),
        (b'{"request_id": "a", "prompt_ids": [1, Infinity]}', "Infinity is not", "prompt_ids"),
        (b'{"request_id": "a", "prompt_ids": [1], "timeout_s": 1e400}', "out of range",
         "timeout_s"),
        (b'{"request_id": "a", "prompt_ids": [1], "timeout_s": 1' + b"0" * 400 + b"}",
         "out of range", "timeout_s"),
        (b'{"request_id": "a", "prompt_ids": [' + b"9" * 5000 + b"]}", "out of range",
         "prompt_ids"),
        (b'{"request_id": "a", "prompt_ids": [1], "params": ' + b"[" * 100 + b"]" * 100 + b"}",
         "Expected `object`, got `array`", "params"),
        (b'{"request_id": "a", "prompt_ids": [1], "extra": ' + b"[" * 10**5 + b"]" * 10**5 + b"}",
         "unknown field `extra`", "extra"),
        (b'{"request_id": "a", "prompt_ids": [[' + b"[" * 10**5, "got `array`", "prompt_ids"),
        (b"[" * 100_000, "Expected `object`, got `array`", None),
        (b'{"request_id": "a", "prompt_ids": [1, 2', "truncated - at `$.prompt_ids[1]`",
         "prompt_ids"),
        (b'{"request_id": "a", "prompt_ids": [1], "params": {"seed": 1,, "top_k": 2}}',
         "not valid JSON", "params"),
        (b'{"prompt_ids": [1]}', "missing required field `request_id`", "request_id"),
        (b'{"request_id": "a", "prompt_ids": [1], "params": {"seed": "7"}}', "`$.params.seed`",
         "seed"),
        (b'{"request_id": "a", "prompt_ids": [1], "params": {"logit_bias": [[1, true]]}}',
         "got `bool`", "logit_bias"),
        (b'{"request_id": "a", "prompt_ids": [1], "prefill": null}', "got `null`", "prefill"),
        (b'{"request_id": "a\\\\\\"{[:,\\"", "prompt_ids": [1, NaN]}', "NaN", "prompt_ids"),
        (b'{"request_id": "' + b"\\\\" * 10**5 + b'\\ud800"}', "surrogate", "request_id"),
        # past MAX_PATH_TOKENS before the fault (repeated keys): refused, no field named
        (b"{" + b'"request_id": "a", ' * 5000 + b'"prompt_ids": [1,,]}', "not valid JSON", None),
        (b"", "truncated", None),
        (b"null", "Expected `object`, got `null`", None),
        (b"5", "Expected `object`, got `int`", None),
    ],
)  # fmt: skip
def test_each_hazard_has_its_own_message_naming_the_field(
    raw: bytes, words: str, param: str | None
) -> None:
    got = answer(raw)
    assert isinstance(got, tuple) and words in got[0] and got[1] == param, got


def test_a_duplicate_key_counts_its_last_value_as_python_s_json_does() -> None:
    got = answer(b'{"request_id": "a", "request_id": "b", "prompt_ids": [1]}')
    assert isinstance(got, Generate) and got.request_id == "b"
    assert answer(b'{"request\\u005fid": "\\u0061", "prompt_ids": [-0]}') == Generate(
        request_id="a", prompt_ids=[0]
    )


def test_a_timeout_is_kept_as_a_float_and_bounded() -> None:
    g = decode_generate(b'{"request_id": "a", "prompt_ids": [1], "timeout_s": 5}')
    assert isinstance(g.timeout_s, float) and g.timeout_s == 5.0
    for bad in (b"0", b"-1", b"1000001", b"true", b'"5"'):
        raw = b'{"request_id": "a", "prompt_ids": [1], "timeout_s": ' + bad + b"}"
        assert answer(raw)[1] == "timeout_s", bad  # type: ignore[index]
