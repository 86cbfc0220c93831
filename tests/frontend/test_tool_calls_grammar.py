"""frontend/tool_calls/grammar.py through tool_use.py: the grammar that tool_choice "required"
or a named function puts on the output matches calls in the parser's own format, and only
those, with arguments valid against the function's schema, and the parser reads back exactly
the calls the grammar let through. Matched by llguidance over the built-in models' trained
tokenizer, each format's markers added as special tokens where the family has them so."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest

from pdserve.frontend.structured import build_constraint
from pdserve.frontend.tool_calls import PARSERS, StreamParser
from pdserve.frontend.tool_calls.grammar import closed
from pdserve.frontend.tool_use import ToolCalling
from pdserve.frontend.tools import parse_tools
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.constraint import ConstraintKind, grammar_source
from tests.frontend.tool_models import EOS, TOOLS, hermes, tokenizer

PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
TOKYO = ("get_time", {"zone": "Asia/Tokyo"})
NEWS = ("get_news", {"topic": "x"})
KELVIN = ("get_weather", {"city": "Paris", "unit": "kelvin"})
EXTRA = ("get_weather", {"city": "Paris", "unit": "celsius", "country": "FR"})
DS = {
    k: v
    for k, v in (
        ("B", "<｜tool▁calls▁begin｜>"),
        ("E", "<｜tool▁calls▁end｜>"),
        ("b", "<｜tool▁call▁begin｜>"),
        ("e", "<｜tool▁call▁end｜>"),
        ("s", "<｜tool▁sep｜>"),
    )
}


def llama3(*calls: tuple[str, dict[str, Any]]) -> str:
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def mistral_v7(*calls: tuple[str, dict[str, Any]]) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def mistral_v11(*calls: tuple[str, dict[str, Any]]) -> str:
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)


def deepseek(*calls: tuple[str, dict[str, Any]]) -> str:
    b, e, s = DS["b"], DS["e"], DS["s"]
    body = "\n".join(f"{b}function{s}{n}\n```json\n{json.dumps(a)}\n```{e}" for n, a in calls)
    return DS["B"] + body + DS["E"]


FORMATS = {  # (parser, the markers the tokenizer has as special tokens, how calls are written)
    "hermes": ("hermes", (), hermes),
    "llama3_json": ("llama3_json", ("<|python_tag|>",), llama3),
    "mistral_v7": ("mistral", ("[TOOL_CALLS]",), mistral_v7),
    "mistral_v11": ("mistral", ("[TOOL_CALLS]", "[ARGS]"), mistral_v11),
    "deepseek_v3": ("deepseek_v3", tuple(DS.values()), deepseek),
    "deepseek_v3_text": ("deepseek_v3", (), deepseek),  # markers that are plain text
}


def grammar(tok: Tokenizer, parser: str, **body: Any) -> str:
    request = parse_tools({"tools": TOOLS, **body})
    use, asked = ToolCalling(tok, parser).plan(request, None, None)
    assert use is not None and asked is not None and asked.field == "tools"
    constraint = build_constraint(asked)  # it compiles
    assert constraint.kind is ConstraintKind.GRAMMAR
    return constraint.spec


def matches(tok: Tokenizer, spec: str, text: str) -> bool:
    vocab = llguidance.LLTokenizer(tok.to_json(), n_vocab=tok.vocab_size, eos_token=[EOS])
    m = llguidance.LLMatcher(vocab, grammar_source(ConstraintKind.GRAMMAR, spec), log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.consume_token(EOS)


@pytest.mark.parametrize("form", sorted(FORMATS))
def test_required_matches_the_formats_calls_and_the_parser_reads_them(form):
    name, special, write = FORMATS[form]
    tok = tokenizer(None, special)
    spec = grammar(tok, name, tool_choice="required")
    parser: type[StreamParser] = PARSERS[name]
    for calls in [(PARIS,), (TOKYO,), (PARIS, TOKYO, PARIS)]:
        text = write(*calls)
        assert matches(tok, spec, text), (form, text)
        parsed = parser.parse(text)
        assert parsed.content == ""
        assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == list(calls)
    for calls in [(NEWS,), (KELVIN,), (EXTRA,), (PARIS, NEWS)]:
        assert not matches(tok, spec, write(*calls)), (form, calls)
    assert not matches(tok, spec, "Sure. " + write(PARIS))  # calls only
    assert not matches(tok, spec, "")  # at least one


@pytest.mark.parametrize("form", sorted(FORMATS))
def test_a_named_function_is_one_call_to_it(form):
    name, special, write = FORMATS[form]
    tok = tokenizer(None, special)
    spec = grammar(tok, name, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert matches(tok, spec, write(TOKYO))
    assert not matches(tok, spec, write(PARIS))
    assert not matches(tok, spec, write(TOKYO, TOKYO))


def test_without_parallel_tool_calls_required_is_one_call():
    tok = tokenizer(None)
    spec = grammar(tok, "hermes", tool_choice="required", parallel_tool_calls=False)
    assert matches(tok, spec, hermes(PARIS)) and matches(tok, spec, hermes(TOKYO))
    assert not matches(tok, spec, hermes(PARIS, TOKYO))


def test_special_markers_are_their_tokens_and_text_markers_their_text():
    special = tokenizer(None, ("[TOOL_CALLS]", "[ARGS]"))
    spec = grammar(special, "mistral", tool_choice="required")
    ids = [special.token_id("[TOOL_CALLS]"), special.token_id("[ARGS]")]
    assert f"<[{ids[0]}]>" in spec and f"<[{ids[1]}]>" in spec and '"[ARGS]"' not in spec
    text = grammar(tokenizer(None), "hermes", tool_choice="required")
    assert '"<tool_call>"' in text and "<[" not in text


def test_objects_that_list_their_properties_are_closed_to_others():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {}}},
            "free": {"type": "object"},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "list": {"type": "array", "items": {"type": "object", "properties": {"x": {}}}},
        },
    }
    got = closed(schema)
    props = got["properties"]
    assert got["additionalProperties"] is False
    assert props["a"]["additionalProperties"] is False
    assert props["list"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]  # lists none: any object
    assert props["open"]["additionalProperties"] is True
    assert "additionalProperties" not in closed({"properties": {"a": {}}, "allOf": [{}]})
    assert schema["properties"]["a"] == {"type": "object", "properties": {"b": {}}}  # a copy


def test_a_union_beside_listed_properties_stays_satisfiable():
    """A discriminated union (shared `kind`, branches adding fields): closing the object and
    its branches would forbid each other's properties and make the schema unsatisfiable."""
    union = {
        "type": "object",
        "properties": {"kind": {"enum": ["cat", "dog"]}},
        "required": ["kind"],
        "anyOf": [
            {"properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}}},
            {"properties": {"kind": {"const": "dog"}, "bark": {"type": "boolean"}}},
        ],
    }
    got = closed(union)
    assert "additionalProperties" not in got
    assert all("additionalProperties" not in b for b in got["anyOf"])
    # A union of whole objects, with nothing listed beside it, still closes each branch.
    plain = closed({"anyOf": [{"type": "object", "properties": {"x": {}}}]})
    assert plain["anyOf"][0]["additionalProperties"] is False
    from pdserve.protocol.constraint import Constraint, ConstraintKind

    Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=json.dumps(got)).check_compiles()


NESTED_TOOL = {  # what pydantic writes for a nested model: a $ref into the schema's own $defs
    "type": "object",
    "properties": {"where": {"$ref": "#/$defs/Loc"}, "days": {"type": "integer"}},
    "required": ["where"],
    "$defs": {
        "Loc": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
        }
    },
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("named", [False, True])
def test_a_function_schema_with_refs_can_be_forced(fmt, named):
    """pydantic's nested models are `$ref`s to the parameters' own `$defs`: under an envelope
    they must still resolve (they used to reach for the envelope's root and fail), and the
    grammar must still take a call whose arguments follow them."""
    parser, special, write = FORMATS[fmt]
    tools = [
        {"type": "function", "function": {"name": "trip", "parameters": NESTED_TOOL}},
        {"type": "function", "function": {"name": "other", "parameters": NESTED_TOOL}},
    ]
    choice = {"type": "function", "function": {"name": "trip"}} if named else "required"
    request = parse_tools({"tools": tools, "tool_choice": choice})
    tok = tokenizer(None, special)
    use, asked = ToolCalling(tok, parser).plan(request, None, None)
    assert use is not None and asked is not None
    spec = build_constraint(asked).spec  # it compiles (a 400 before)
    text = write(("trip", {"where": {"city": "Oslo"}, "days": 3}))
    assert matches(tok, spec, text), text
    bad = write(("trip", {"where": {"city": "Rome"}}))  # not one of the $ref'd enum
    assert not matches(tok, spec, bad), bad
