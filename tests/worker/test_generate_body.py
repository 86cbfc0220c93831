"""A /generate body parses to one answer whichever decoder reads it: the typed fast one takes
every well-formed body, and on every other body (hostile ones, random mutations) its answer, if
it gives one, is the general decoder's; the errors are always the general decoder's."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from pdserve.protocol.sampling import SamplingParams, validate_prompt
from pdserve.server.api_error import ApiError
from pdserve.server.json_body import parse_json_body
from pdserve.worker.http import generate_body
from pdserve.worker.http.generate_body import Generate, parse_generate

VOCAB, MAX_LEN = 1000, 4096


def validate(prompt_ids: list[int], params: SamplingParams) -> None:
    validate_prompt(prompt_ids, params, VOCAB, MAX_LEN)


def general(raw: bytes, charset: str | None = None) -> Generate | tuple[int, str, str | None]:
    """The general decoder's answer: the fields, or the error's status, message and param."""
    try:
        return generate_body._general(parse_json_body(raw, charset), validate)
    except ApiError as e:
        return e.status, e.message, e.param


def answer(raw: bytes, charset: str | None = None) -> Generate | tuple[int, str, str | None]:
    try:
        return parse_generate(raw, charset, validate)
    except ApiError as e:
        return e.status, e.message, e.param


def body(**kw: Any) -> dict[str, Any]:
    return {"request_id": "r1", "prompt_ids": [1, 2, 3], **kw}


GOOD = [
    body(),
    body(params={}),
    body(params={"max_tokens": 7, "temperature": 0, "seed": -3, "stop_token_ids": [5, 6]}),
    body(params={"logit_bias": [[3, 1.5], [9, -100]], "logprobs": 2, "top_k": 1}),
    body(params={"prompt_logprobs": 1, "max_tokens": 0}),
    body(timeout_s=5),
    body(timeout_s=0.25),
    body(timeout_s=None),
    body(prefill="tcp://[::1]:5555"),
    body(prefill="tcp://prefill-0.cluster.local:65535", channel="router-7"),
    body(channel="c" * 256),
    body(prompt_ids=list(range(VOCAB)) * 4),
    body(request_id="x" * 256, prompt_ids=[VOCAB - 1]),
]

# Values that any field may be swapped for: every JSON type, edges, and what Python's json
# takes that a typed decoder might not (NaN, huge ints, lone surrogates).
HOSTILE = [
    None, True, False, 0, -1, 1, 2.0, 1.5, 10**30, 2**63, 2**64, -(2**63) - 1, float("nan"),
    float("inf"), "", "x", "a\nb", "é", "a\ud800b", "tcp://h:1", [], [1], [True], [1.0], [[1]],
    {}, {"max_tokens": 1}, {"bogus": 1}, {"seed": "1"}, "x" * 300,
]  # fmt: skip
PARAM_NAMES = ["max_tokens", "seed", "top_k", "temperature", "stop_token_ids", "logit_bias",
               "min_tokens", "prompt_logprobs", "bogus"]  # fmt: skip
FIELDS = ["request_id", "prompt_ids", "params", "timeout_s", "prefill", "channel", "extra"]


def encode(value: Any) -> bytes:
    return json.dumps(value).encode()  # NaN and Infinity as Python's json writes them


def test_the_fast_decoder_takes_every_good_body_and_agrees() -> None:
    for b in GOOD:
        raw = encode(b)
        fast = generate_body._fast(raw, None, validate)
        assert fast is not None, b
        assert fast == general(raw) == answer(raw), b
        assert answer(raw, "utf-8") == fast


def test_every_field_swapped_for_every_hostile_value_gets_the_general_answer() -> None:
    refused = taken = 0
    for field in FIELDS:
        for value in HOSTILE:
            raw = encode(body(**{field: value}))
            want = general(raw)
            assert answer(raw) == want, (field, value)
            fast = generate_body._fast(raw, None, validate)
            assert fast is None or fast == want, (field, value)
            refused += not isinstance(want, Generate)
            taken += fast is not None
    assert refused > 150 and taken > 5  # both kinds occur, so the comparison means something


@pytest.mark.parametrize(
    "raw",
    [
        b'{"request_id": "a", "request_id": "b", "prompt_ids": [1]}',  # the last one counts
        b'{"request_id": "a", "prompt_ids": [1], "prompt_ids": [true]}',
        b'{"request_id": "a\\ud800", "prompt_ids": [1]}',
        b'{"request_id": "\\u0061", "prompt_ids": [1]}',
        b'{"request\\u005fid": "a", "prompt_ids": [1]}',
        b'{"request_id": "\xc3\xa9", "prompt_ids": [1]}',
        b'{"request_id": "\xff", "prompt_ids": [1]}',
        b'\xef\xbb\xbf{"request_id": "a", "prompt_ids": [1]}',
        b'{"request_id": "a", "prompt_ids": [1]} x',
        b'{"request_id": "a", "prompt_ids": [1], "timeout_s": NaN}',
        b'{"request_id": "a", "prompt_ids": [1], "timeout_s": 1e400}',
        b'{"request_id": "a", "prompt_ids": [1], "timeout_s": 1' + b"0" * 400 + b"}",
        b'{"request_id": "a", "prompt_ids": [' + b"9" * 5000 + b"]}",
        b'{"request_id": "a", "prompt_ids": [1], "params": ' + b"[" * 100 + b"]" * 100 + b"}",
        b"[" * 100_000,
        b"",
        b"null",
        b"5",
    ],
)
def test_hazards_get_the_general_answer(raw: bytes) -> None:
    assert answer(raw) == general(raw)


@pytest.mark.parametrize("charset", ["utf-16", "hex", "rot13", "no-such-charset", "utf-8-sig"])
def test_a_body_in_a_charset_other_than_utf8_gets_the_general_answer(charset: str) -> None:
    raw = encode(body())  # ASCII: the typed decoder would take it, were it asked
    assert generate_body._fast(raw, charset, validate) is None
    assert answer(raw, charset) == general(raw, charset)


@pytest.mark.parametrize("charset", ["utf-8", "UTF-8", "utf8", "U8"])
def test_every_name_of_utf8_takes_the_fast_decoder(charset: str) -> None:
    raw = encode(body())
    fast = generate_body._fast(raw, charset, validate)
    assert fast is not None and fast == general(raw, charset)


def test_a_body_in_another_charset_goes_to_the_general_decoder() -> None:
    raw = json.dumps(body(request_id="é"), ensure_ascii=False).encode("latin-1")
    assert answer(raw, "latin-1") == general(raw, "latin-1")
    assert isinstance(answer(raw, "latin-1"), Generate)
    assert answer(raw, "no-such-charset") == general(raw, "no-such-charset")
    assert not isinstance(answer(raw, "no-such-charset"), Generate)


def test_random_mutations_of_good_bodies_get_the_general_answer() -> None:
    rng = random.Random(13)
    kinds: dict[str, int] = {"fast": 0, "refused": 0}
    for _ in range(1500):
        b = dict(rng.choice(GOOD))
        for _ in range(rng.randint(1, 3)):
            field = rng.choice(FIELDS)
            if rng.random() < 0.2:
                b.pop(field, None)
            elif field == "params":
                p = dict(b.get("params") or {})
                p[rng.choice(PARAM_NAMES)] = rng.choice(HOSTILE)
                b["params"] = p
            elif field == "prompt_ids" and isinstance(b.get("prompt_ids"), list):
                ids = list(b["prompt_ids"]) or [0]
                ids[rng.randrange(len(ids))] = rng.choice([0, VOCAB, -1, True, 1.0, 2**64, "1"])
                b["prompt_ids"] = ids
            else:
                b[field] = rng.choice(HOSTILE)
        raw = encode(b)
        want = general(raw)
        assert answer(raw) == want, b
        kinds["fast"] += generate_body._fast(raw, None, validate) is not None
        kinds["refused"] += not isinstance(want, Generate)
    assert kinds["fast"] > 100 and kinds["refused"] > 500, kinds
