"""The structured-output fields (frontend/structured.py) on both endpoints: OpenAI's
response_format, vLLM's structured_outputs and guided_* become one asked constraint, which
builds one Constraint; two constraints, a malformed field or a spec that cannot compile are a
400 whose OpenAI-style body names the field the client sent. (The API builds it off the event
loop: tests/frontend/test_constraint_off_loop.py; here it is built in line.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.frontend.protocol import ApiError, bad, parse_chat, parse_completion
from pdserve.frontend.structured import build_constraint
from pdserve.protocol.constraint import Constraint, ConstraintKind
from pdserve.protocol.invalid_params import InvalidParams
from pdserve.server.json_body import MAX_JSON_DEPTH

K = ConstraintKind
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
DONE = {"prompt": "x"}
SCHEMA = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
ENDPOINTS = pytest.mark.parametrize(
    "parse,base", [(parse_chat, CHAT), (parse_completion, DONE)], ids=["chat", "completion"]
)


def constraint(parse: Any, body: dict[str, Any]) -> Constraint | None:
    """The body's Constraint as the API builds it (there off the loop), refusals as its 400s."""
    asked = parse(body).constraint
    try:
        return None if asked is None else build_constraint(asked)
    except InvalidParams as e:
        raise bad(str(e), e.param) from e


@ENDPOINTS
@pytest.mark.parametrize(
    "fields,kind,spec",
    [
        ({"response_format": {"type": "json_object"}}, K.JSON_OBJECT, ""),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
                }
            },
            K.JSON_SCHEMA,
            json.dumps(SCHEMA),  # the client's key order kept
        ),
        ({"structured_outputs": {"json": SCHEMA}}, K.JSON_SCHEMA, json.dumps(SCHEMA)),
        ({"structured_outputs": {"regex": "a+", "json": None}}, K.REGEX, "a+"),
        ({"structured_outputs": {"choice": ["x", "y"]}}, K.CHOICE, '["x", "y"]'),
        pytest.param(  # GBNF: converted in the converter's child process
            {"structured_outputs": {"grammar": 'root ::= "a"'}},
            K.GRAMMAR,
            'root ::= "a"',
            marks=pytest.mark.process,
        ),
        ({"structured_outputs": {"json_object": True}}, K.JSON_OBJECT, ""),
        ({"guided_json": json.dumps(SCHEMA)}, K.JSON_SCHEMA, json.dumps(SCHEMA)),
        ({"guided_regex": "[0-9]+"}, K.REGEX, "[0-9]+"),
        ({"guided_choice": ["é", "b"]}, K.CHOICE, '["é", "b"]'),
        ({"guided_grammar": 'start: "a"'}, K.GRAMMAR, 'start: "a"'),
    ],
)
def test_each_field_becomes_one_constraint(parse, base, fields, kind, spec):
    got = parse({**base, **fields}, strict=True)  # known fields, even when strict
    assert got.params.constraint is None  # built later, off the loop
    assert got.constraint is not None and got.constraint[1:3] == (kind, spec)
    assert build_constraint(got.constraint) == Constraint(kind=kind, spec=spec)


@ENDPOINTS
@pytest.mark.parametrize(
    "fields",
    [{}, {"response_format": {"type": "text"}}, {"response_format": None}, {"guided_regex": None}]
    + [{"structured_outputs": {"json_object": False, "regex": None}}],
)
def test_no_constraint(parse, base, fields):
    spec = parse({**base, **fields})
    assert spec.constraint is None and spec.params.constraint is None


@ENDPOINTS
@pytest.mark.parametrize(
    "fields,param,why",
    [
        ({"response_format": {"type": "regex"}}, "response_format", "must be"),
        ({"response_format": "json"}, "response_format", "must be"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
            "response_format.json_schema.schema",
            "required",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schemas": {}}}},
            "response_format.json_schema",
            "unknown field",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {}, "strict": 1},
                }
            },
            "response_format.json_schema.strict",
            "bool",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            "response_format.json_schema.schema",
            "does not compile: Invalid type: x",
        ),
        ({"guided_json": "{nope"}, "guided_json", "not JSON"),
        ({"guided_json": [1]}, "guided_json", "JSON schema"),
        ({"guided_json": {"$ref": "#/nowhere"}}, "guided_json", "does not exist"),
        # JSON text nested past Python's recursion limit, and just past the body's own bound
        ({"guided_json": "[" * 50_000}, "guided_json", "nests deeper than 64 levels"),
        ({"guided_json": '{"a":' * 65 + "1" + "}" * 65}, "guided_json", "nests deeper"),
        (
            {"structured_outputs": {"json": '{"anyOf":[' * 30_000}},
            "structured_outputs.json",
            "nests deeper than 64 levels",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": "[" * 9999}}},
            "response_format.json_schema.schema",
            "nests deeper",
        ),
        ({"guided_regex": "(a"}, "guided_regex", "does not compile"),
        ({"guided_regex": ""}, "guided_regex", "non-empty string"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_choice": "a"}, "guided_choice", "non-empty list"),
        ({"guided_grammar": "start: nothing"}, "guided_grammar", "unknown name"),
        ({"structured_outputs": ["a"]}, "structured_outputs", "object"),
        ({"structured_outputs": {"backend": "x"}}, "structured_outputs.backend", "not supported"),
        ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object", "true"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs.choice",
            "second output constraint",
        ),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "second output constraint besides 'response_format'",
        ),
    ],
)
def test_refusals_are_400_naming_the_field(parse, base, fields, param, why):
    with pytest.raises(ApiError) as e:
        constraint(parse, {**base, **fields})
    body: dict[str, Any] = e.value.body()["error"]
    assert e.value.status == 400 and body["type"] == "invalid_request_error"
    assert body["param"] == param and why in body["message"], body


@ENDPOINTS
def test_a_schema_text_as_deep_as_the_body_allows_is_taken(parse, base):
    inner = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})  # 3 deep
    for wraps, ok in [(30, True), (31, False)]:  # each wrap an object and a list: 63, 65
        text = '{"allOf": [' * wraps + inner + "]}" * wraps
        if ok:
            got = constraint(parse, {**base, "guided_json": text})
            assert got == Constraint(kind=K.JSON_SCHEMA, spec=text)
        else:
            with pytest.raises(ApiError, match=f"nests deeper than {MAX_JSON_DEPTH} levels"):
                parse({**base, "guided_json": text})


def test_n_choices_share_the_constraint():
    spec = parse_chat({**CHAT, "n": 3, "guided_regex": "a+"})
    assert spec.n == 3 and spec.constraint is not None
    params = spec.params.replace(constraint=build_constraint(spec.constraint))
    assert params.constraint == Constraint(kind=K.REGEX, spec="a+")
    assert params.replace(seed=5).constraint is params.constraint  # not built again
