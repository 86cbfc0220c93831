"""The structured-output constraint (protocol/constraint.py): checked and compiled when built,
refused with InvalidParams naming `constraint` on every wire (SamplingParams' builtins, the
/generate body), and carried unchanged by SamplingParams."""

from __future__ import annotations

import json

import msgspec
import pytest

from pdserve.protocol.constraint import (
    CONVERSION_SHARE,
    MAX_CONSTRAINT_BYTES,
    Constraint,
    ConstraintKind,
    compile_error,
    conversion_bound,
    convert_here,
    grammar_source,
)
from pdserve.protocol.generate import decode_generate
from pdserve.protocol.grammar_thread import GRAMMAR_THREAD
from pdserve.protocol.sampling import InvalidParams, SamplingParams

K = ConstraintKind
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
GOOD = [
    (K.JSON_SCHEMA, json.dumps(SCHEMA)),
    (K.JSON_SCHEMA, "true"),
    # a discriminated union: `oneOf` compiles as `anyOf` (llguidance's coerce_one_of)
    (
        K.JSON_SCHEMA,
        json.dumps({"oneOf": [{"const": "a"}, {"type": "object", "properties": {"k": {}}}]}),
    ),
    (K.JSON_OBJECT, ""),
    (K.REGEX, "[a-z]+@[a-z]+\\.com"),
    (K.CHOICE, json.dumps(["yes", "no"])),
    (K.GRAMMAR, 'start: "a" | "b"'),  # Lark
    (K.GRAMMAR, 'root ::= "a" | "b"'),  # GBNF
]
BAD = [
    (K.JSON_SCHEMA, json.dumps({"type": "objectx"}), "Invalid type"),
    (K.JSON_SCHEMA, json.dumps({"properties": {"a": {"$ref": "#/nope"}}}), "does not exist"),
    (K.JSON_SCHEMA, "{not json", "does not compile"),
    (K.JSON_SCHEMA, "5", "object or true"),
    (K.JSON_SCHEMA, "false", "object or true"),
    (K.JSON_OBJECT, "{}", "no spec"),
    (K.REGEX, "[a-", "unclosed character class"),
    (K.CHOICE, "[]", "non-empty list"),
    (K.CHOICE, json.dumps(["a", 1]), "non-empty list"),
    (K.GRAMMAR, "start: foo", "unknown name"),
    (K.GRAMMAR, "garbage !!! ###", "GBNF"),
    # JSON nested past Python's recursion limit (a spec off the wire: P, D's /generate)
    (K.JSON_SCHEMA, "[" * 50_000, "nests too deeply"),
    (K.CHOICE, "[" * 50_000, "nests too deeply"),
]


@pytest.mark.parametrize("kind,spec", GOOD)
def test_good_constraints_compile_and_round_trip(kind, spec):
    c = Constraint(kind=kind, spec=spec)
    c.check_compiles()
    p = SamplingParams(max_tokens=4, constraint=c)
    wire = p.to_builtins()
    assert wire["constraint"] == {"kind": kind.value, "spec": spec}
    assert SamplingParams.from_builtins(wire) == p
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p


@pytest.mark.parametrize("kind,spec,why", BAD)
def test_bad_constraints_are_refused_naming_the_field(kind, spec, why):
    """Whether a constraint compiles is its own check (the sides facing a client make it);
    decoding one off the wire costs nothing, so any thread may (P's control thread)."""
    c = Constraint(kind=kind, spec=spec)
    with pytest.raises(InvalidParams, match=why) as e:
        c.check_compiles()
    assert e.value.param == "constraint"
    wire = {"constraint": {"kind": kind.value, "spec": spec}}
    assert SamplingParams.from_builtins(wire).constraint == c
    body = {"request_id": "r", "prompt_ids": [1], "params": wire}
    assert decode_generate(json.dumps(body).encode()).params.constraint == c


@pytest.mark.parametrize(
    "value",
    [
        "regex",
        5,
        {"kind": "nope", "spec": ""},
        {"kind": "regex", "spec": 5},
        {"kind": "regex", "spec": "a", "x": 1},
        {"spec": "a"},
    ],
)
def test_a_malformed_wire_constraint_names_the_field(value):
    with pytest.raises(InvalidParams) as e:
        SamplingParams.from_builtins({"max_tokens": 3, "constraint": value})
    assert e.value.param == "constraint", e.value


def test_another_fields_error_is_reported_before_a_good_constraint():
    wire = {"temperature": "hot", "constraint": {"kind": "regex", "spec": "a+"}}
    with pytest.raises(InvalidParams) as e:
        SamplingParams.from_builtins(wire)
    assert e.value.param == "temperature"


def test_size_and_text_bounds():
    Constraint(kind=K.REGEX, spec="a" * MAX_CONSTRAINT_BYTES)
    with pytest.raises(InvalidParams, match="bytes"):
        Constraint(kind=K.REGEX, spec="a" * (MAX_CONSTRAINT_BYTES + 1))
    with pytest.raises(InvalidParams, match="bytes"):  # counted in UTF-8
        Constraint(kind=K.REGEX, spec="é" * (MAX_CONSTRAINT_BYTES // 2 + 1))
    with pytest.raises(InvalidParams, match="not valid text"):
        Constraint(kind=K.REGEX, spec="\ud800")
    with pytest.raises(InvalidParams, match="kind"):
        Constraint(kind="regex", spec="a")  # type: ignore[arg-type]
    with pytest.raises(InvalidParams, match="constraint must be an object"):
        SamplingParams(constraint={"kind": "regex", "spec": "a"})  # type: ignore[arg-type]


def test_the_compile_check_is_cached():
    compile_error.cache_clear()
    for _ in range(3):
        Constraint(kind=K.REGEX, spec="x+y").check_compiles()
    info = compile_error.cache_info()
    assert (info.misses, info.hits) == (1, 2)


class FakeToLark:
    """A GBNF converter that answers `answer` (text, or an exception to raise) and notes what
    it was asked."""

    def __init__(self, answer: str | BaseException) -> None:
        self.answer = answer
        self.asked: list[tuple[str, float]] = []

    def __call__(self, gbnf: str, timeout_s: float) -> str:
        self.asked.append((gbnf, timeout_s))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def test_gbnf_is_converted_by_the_callers_to_lark_and_lark_is_not():
    gbnf = 'root ::= "a" | "b"'
    to_lark = FakeToLark(convert_here(gbnf, 0.0))
    source = grammar_source(K.GRAMMAR, gbnf, to_lark)
    bound = GRAMMAR_THREAD.timeout_s * CONVERSION_SHARE  # inside the compile's own bound
    assert (
        to_lark.asked == [(gbnf, bound)] and bound == conversion_bound() < GRAMMAR_THREAD.timeout_s
    )
    assert source == grammar_source(K.GRAMMAR, gbnf)  # as converted on this thread
    grammar_source(K.GRAMMAR, 'start: "a"', to_lark)  # Lark: nothing to convert
    assert len(to_lark.asked) == 1
    with pytest.raises(ValueError, match="GBNF grammar does not convert to Lark: no"):
        grammar_source(K.GRAMMAR, gbnf, FakeToLark(ValueError("no")))


def test_a_conversion_too_slow_is_refused_and_remembered_one_not_run_is_busy():
    compile_error.cache_clear()
    slow, down = FakeToLark(TimeoutError("too slow")), FakeToLark(OSError("no converter"))
    for _ in range(2):
        with pytest.raises(InvalidParams, match="grammar does not compile: too slow"):
            Constraint(kind=K.GRAMMAR, spec='root ::= "s"').check_compiles(slow)
        with pytest.raises(InvalidParams, match="grammar was not compiled: .*no converter"):
            Constraint(kind=K.GRAMMAR, spec='root ::= "d"').check_compiles(down)
    assert (len(slow.asked), len(down.asked)) == (1, 2)  # the timeout remembered, busy not
    compile_error.cache_clear()
