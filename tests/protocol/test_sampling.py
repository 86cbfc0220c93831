"""SamplingParams as a struct: its checks, `replace`, and its one wire converter."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from pdserve.protocol import messages as m
from pdserve.protocol.sampling import InvalidParams, SamplingParams, validate_prompt

NAN, HUGE = float("nan"), 10**400
FULL = SamplingParams(
    max_tokens=9,
    temperature=0.7,
    top_p=0.9,
    top_k=5,
    min_p=0.1,
    seed=2**64 - 1,
    repetition_penalty=1.1,
    frequency_penalty=-0.5,
    presence_penalty=0.5,
    ignore_eos=True,
    stop_token_ids=(3, 4),
    min_tokens=2,
    logprobs=20,
    logit_bias=((0, -100), (7, 2.5), (2**31 - 1, 100.0)),
    include_stop_str_in_output=True,
)


def test_it_is_a_frozen_struct_with_the_derived_flags() -> None:
    with pytest.raises(AttributeError):
        FULL.max_tokens = 1  # type: ignore[misc]
    assert not FULL.greedy and FULL.needs_penalties and FULL.needs_filtering
    plain = SamplingParams(temperature=0)
    assert plain.greedy and not plain.needs_penalties and not plain.needs_filtering
    assert hash(FULL) == hash(FULL.replace())


def test_replace_validates_like_construction() -> None:
    assert FULL.replace(max_tokens=1, min_tokens=0).max_tokens == 1
    with pytest.raises(InvalidParams, match=r"min_tokens must be an integer in \[0, 1\]") as e:
        FULL.replace(max_tokens=1)
    assert e.value.param == "min_tokens"
    with pytest.raises(InvalidParams):
        FULL.replace(temperature=NAN)


def test_the_wire_form_round_trips_over_json_and_the_control_plane() -> None:
    for p in (FULL, SamplingParams()):
        d = p.to_builtins()
        assert set(d) == set(SamplingParams.__struct_fields__)
        assert SamplingParams.from_builtins(d) == p
        assert SamplingParams.from_builtins(json.loads(json.dumps(d))) == p
        req = m.PrefillRequest(prompt_ids=[1], dst_pages=[0], params=p, write_deadline=1.0)
        back = m.decode(m.encode(req))
        assert isinstance(back, m.PrefillRequest)
        assert back.params == p


WIRE_BAD: list[tuple[dict[str, Any], str]] = [
    ({"seed": "x"}, "seed"),  # msgspec refuses the type first
    ({"seed": 2**64}, "seed"),
    ({"top_k": 1.5}, "top_k"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": HUGE}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"temperature": NAN}, "temperature"),  # msgspec takes NaN; __post_init__ refuses it
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"stop_token_ids": [1, 2**70]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": {"a": 1}}, "stop_token_ids"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
    ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"),
]


@pytest.mark.parametrize("d,param", WIRE_BAD)
def test_the_wire_refuses_with_the_message_of_construction(d: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParams) as wire:
        SamplingParams.from_builtins(d)
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    with pytest.raises(InvalidParams) as direct:
        SamplingParams(**kw)
    assert (wire.value.param, str(wire.value)) == (param, str(direct.value))


@pytest.mark.parametrize(
    "d,words",
    [
        ([1], "'params' must be an object, got [1]"),
        (None, "'params' must be an object, got None"),
        ({"nope": 1, "top_p": 0.5}, "unknown sampling params ['nope']"),
        ({1: 2}, "unknown sampling params ['1']"),
    ],
)
def test_the_wire_refuses_what_is_not_params(d: Any, words: str) -> None:
    with pytest.raises(InvalidParams) as e:
        SamplingParams.from_builtins(d)
    assert (e.value.param, str(e.value)) == ("params", words)


def test_msgspec_decoding_runs_the_same_checks() -> None:
    raw = msgspec.json.encode({"temperature": -1})
    with pytest.raises(msgspec.ValidationError, match=r"temperature must be a finite number"):
        msgspec.json.decode(raw, type=SamplingParams)


def test_validate_prompt_refuses_what_no_worker_can_serve() -> None:
    ok = SamplingParams(max_tokens=4)
    validate_prompt([1, 2], ok, vocab_size=10, max_model_len=8)
    cases = [
        ([], ok, "prompt", "the prompt is empty"),
        ([1, 10], ok, "prompt", "prompt token ids must be in [0, 10)"),
        ([-1], ok, "prompt", "prompt token ids must be in [0, 10)"),
        ([1] * 8, ok, "prompt", "the prompt has 8 tokens; this model's context is 8 tokens"),
        ([1] * 5, ok, "max_tokens", "max_tokens 4 + 5 prompt tokens exceeds the context of 8"),
        ([1], ok.replace(stop_token_ids=(9, 10)), "stop_token_ids", "[0, 10), got 10"),
        ([1], ok.replace(logit_bias=((9, 1.0), (12, 1.0))), "logit_bias", "[0, 10), got 12"),
    ]
    for prompt, params, param, msg in cases:
        with pytest.raises(InvalidParams) as e:
            validate_prompt(prompt, params, vocab_size=10, max_model_len=8)
        assert e.value.param == param and msg in str(e.value)


LOGIT_BIAS_BAD: list[tuple[Any, str]] = [
    ([[1]], "(token id, bias) pairs"),
    ([[1, 2, 3]], "(token id, bias) pairs"),
    ([5], "(token id, bias) pairs"),
    ([[2, 1.0], [1, 1.0]], "each once and in increasing order"),
    ([[1, 1.0], [1, 2.0]], "each once and in increasing order"),
    ([[-1, 1.0]], "token ids must be integers"),
    ([[2**31, 1.0]], "token ids must be integers"),
    ([[True, 1.0]], "token ids must be integers"),
    ([["1", 1.0]], "token ids must be integers"),
    ([[1, 100.5]], "values must be numbers in [-100, 100]"),
    ([[1, -101]], "values must be numbers in [-100, 100]"),
    ([[1, NAN]], "values must be numbers in [-100, 100]"),
    ([[1, True]], "values must be numbers in [-100, 100]"),
    ([[1, HUGE]], "values must be numbers in [-100, 100]"),
    ([[i, 1.0] for i in range(301)], "at most 300 token ids"),
    ({"1": 1.0}, "at most 300 token ids"),  # the wire form is pairs, not OpenAI's object
]


@pytest.mark.parametrize("bias,words", LOGIT_BIAS_BAD)
def test_logit_bias_is_checked_on_the_wire_and_on_construction(bias: Any, words: str) -> None:
    with pytest.raises(InvalidParams) as wire:
        SamplingParams.from_builtins({"logit_bias": bias})
    assert wire.value.param == "logit_bias" and words in str(wire.value)
    as_tuples = tuple(tuple(e) if isinstance(e, list) else e for e in bias)
    with pytest.raises(InvalidParams) as direct:
        SamplingParams(logit_bias=as_tuples)
    assert direct.value.param == "logit_bias"


def test_logit_bias_and_include_stop_str_keep_their_values_over_the_wire() -> None:
    p = SamplingParams.from_builtins({"logit_bias": [[3, -100], [9, 0.5]]})
    assert p.logit_bias == ((3, -100.0), (9, 0.5))
    for v in (1, "true", None):
        with pytest.raises(InvalidParams) as e:
            SamplingParams.from_builtins({"include_stop_str_in_output": v})
        assert e.value.param == "include_stop_str_in_output"


@pytest.mark.parametrize("name", ["temperature", "seed", "stop_token_ids", "ignore_eos"])
def test_a_lone_surrogate_where_no_string_belongs_is_invalid_params(name: str) -> None:
    # msgspec.convert raises UnicodeEncodeError on it; from_builtins raises nothing but this.
    value: Any = ["\udc00"] if name == "stop_token_ids" else "a\ud800"
    with pytest.raises(InvalidParams) as e:
        SamplingParams.from_builtins({name: value})
    assert e.value.param == name


def _packable(d: dict[str, Any]) -> bool:
    try:
        msgspec.msgpack.encode(d)
    except OverflowError:  # an int past 64 bits never reaches a peer's decoder
        return False
    return True


ON_THE_WIRE = [(d, p) for d, p in WIRE_BAD if _packable(d)]


@pytest.mark.parametrize("d,param", ON_THE_WIRE, ids=[p for _, p in ON_THE_WIRE])
def test_a_prefill_request_with_bad_params_is_an_addressed_decode_error(
    d: dict[str, Any], param: str
) -> None:
    """The control decoder refuses it and says which room it was: P answers a PrefillReject
    naming that room (worker/prefill/role.py) instead of dropping it in silence."""
    fields = {"prompt_ids": [1], "dst_pages": [0], "write_deadline": 1.0, "params": d}
    raw = msgspec.msgpack.encode({"type": "PrefillRequest", "room": 9, "epoch": 2, **fields})
    err = m.decode(raw)
    assert isinstance(err, m.DecodeError) and err.kind == "malformed", err
    assert (err.of, err.room, err.epoch) == ("PrefillRequest", 9, 2)
    assert param in err.detail
