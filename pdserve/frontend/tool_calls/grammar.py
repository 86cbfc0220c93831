r"""The grammar that makes an output tool calls, in the very format its parser reads
(tool_choice "required" or a named function: frontend/tool_use.py).

The model writes its own format, the one its chat template shows and it was trained on,
rather than a JSON form it never saw; the parser reads the result as it reads any output,
so forced and free calls come back alike. One Lark grammar (llguidance's dialect) per
format, each call's arguments an inline `%json` schema (the function's `parameters`), so:

- hermes: `<tool_call>\n{"name": N, "arguments": {...}}\n</tool_call>`, "\n" between calls;
- llama3_json: `{"name": N, "parameters": {...}}`, "; " between calls;
- mistral: `[TOOL_CALLS]N[ARGS]{...}` per call where `[ARGS]` is a token (v11 on), else
  `[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]`;
- deepseek_v3: `<｜tool▁calls▁begin｜>`, then per call (a "\n" between two)
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>N\n```json\n{...}\n```<｜tool▁call▁end｜>`,
  then `<｜tool▁calls▁end｜>`.

A marker the model writes as one special token must be that token in the grammar (text never
matches a special token): `Markers` says which are, from the tokenizer. JSON is written
without free whitespace, as every constraint's (protocol/constraint.py JSON_OPTIONS).
Pure: text in, text out.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.frontend.tool_calls.deepseek_v3 import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    DeepSeekV3,
)
from pdserve.frontend.tool_calls.hermes import CLOSE, OPEN, Hermes
from pdserve.frontend.tool_calls.llama3_json import Llama3Json
from pdserve.frontend.tool_calls.mistral import ARGS, TOOL_CALLS, Mistral
from pdserve.frontend.tool_calls.stream import StreamParser
from pdserve.protocol.constraint import JSON_OPTIONS


class Function(Protocol):
    """What a grammar needs of a declared function (frontend/tools.py `Function`)."""

    @property
    def name(self) -> str: ...

    @property
    def parameters(self) -> dict[str, Any]: ...  # the JSON schema of its arguments, an object


@dataclass(frozen=True)
class Markers:
    """A format's markers as this model's tokens."""

    special: Mapping[str, int]  # marker -> the id of the special token it is
    tokens: frozenset[str]  # the markers that are one token of the vocabulary (special or not)

    def atom(self, marker: str) -> str:
        """`marker` in a Lark rule: its special token, or its text."""
        token = self.special.get(marker)
        return f"<[{token}]>" if token is not None else _literal(marker)


def calls_grammar(
    parser: type[StreamParser],
    functions: Sequence[Function],
    parallel: bool,
    markers: Markers,
) -> str:
    """A Lark grammar of one or more calls (one without `parallel`) to `functions`, written
    as `parser` reads them. ValueError for a parser with no grammar here."""
    build = _GRAMMARS.get(parser.name)
    if build is None:
        raise ValueError(f"no tool call grammar for the {parser.name} format")
    if not functions:
        raise ValueError("a tool call grammar needs at least one function")
    return build(functions, parallel, markers)


# -- the formats -------------------------------------------------------------------------------


def _hermes(functions: Sequence[Function], parallel: bool, m: Markers) -> str:
    return _rules(
        f"start: call{_more(parallel, f'{NL} call')}",
        f"call: {m.atom(OPEN)} {NL} envelope {NL} {m.atom(CLOSE)}",
        f"envelope: %json {_json(_any_envelope(functions, 'arguments'))}",
    )


def _llama3_json(functions: Sequence[Function], parallel: bool, m: Markers) -> str:
    return _rules(
        f"start: envelope{_more(parallel, _literal('; ') + ' envelope')}",
        f"envelope: %json {_json(_any_envelope(functions, 'parameters'))}",
    )


def _mistral(functions: Sequence[Function], parallel: bool, m: Markers) -> str:
    calls = m.atom(TOOL_CALLS)
    if ARGS in m.tokens:  # v11 on: [TOOL_CALLS]name[ARGS]{...}, once per call
        return _rules(
            f"start: call{'+' if parallel else ''}",
            f"call: {calls} function",
            *_alternatives(
                functions,
                lambda f: f"{_literal(f.name)} {m.atom(ARGS)} %json {_json(closed(f.parameters))}",
            ),
        )
    items = _any_envelope(functions, "arguments")
    defs = items.pop("$defs", None)  # refs start at the schema's root: the array's
    array: dict[str, Any] = {"type": "array", "items": items}
    array |= {"minItems": 1} if parallel else {"minItems": 1, "maxItems": 1}
    array |= {"$defs": defs} if defs else {}
    return f"start: {calls} %json {_json(array)}"


def _deepseek_v3(functions: Sequence[Function], parallel: bool, m: Markers) -> str:
    return _rules(
        f"start: {m.atom(CALLS_BEGIN)} call{_more(parallel, f'{NL} call')} {m.atom(CALLS_END)}",
        f'call: {m.atom(CALL_BEGIN)} "function" {m.atom(SEP)} function {_literal(FENCE_END)} '
        f"{m.atom(CALL_END)}",
        *_alternatives(
            functions,
            lambda f: f"{_literal(f.name + FENCE_START)} %json {_json(closed(f.parameters))}",
        ),
    )


_Builder = Callable[[Sequence[Function], bool, Markers], str]
_GRAMMARS: dict[str, _Builder] = {
    Hermes.name: _hermes,
    Llama3Json.name: _llama3_json,
    Mistral.name: _mistral,
    DeepSeekV3.name: _deepseek_v3,
}


# -- pieces ------------------------------------------------------------------------------------

NL = '"\\n"'  # a newline, as a Lark literal
FENCE_START = "\n```json\n"  # DeepSeek-V3's arguments: after the name, in a fence
FENCE_END = "\n```"


def _rules(*rules: str) -> str:
    return "\n".join(rules)


def _alternatives(functions: Sequence[Function], body: Callable[[Function], str]) -> list[str]:
    """`function:` one of the rules f0, f1, ..., rule i for function i."""
    names = [f"f{i}" for i in range(len(functions))]
    return ["function: " + " | ".join(names)] + [
        f"{n}: {body(f)}" for n, f in zip(names, functions, strict=True)
    ]


def _more(parallel: bool, separated: str) -> str:
    """What follows the first call: more of them, each after its separator, or nothing."""
    return f" ({separated})*" if parallel else ""


def _envelope(f: Function, key: str, defs: dict[str, Any], i: int) -> dict[str, Any]:
    params = closed(f.parameters)
    if _has_ref(params):  # its refs are to its own root: keep it whole where they still reach
        defs[f"f{i}"] = _rerooted(params, f"#/$defs/f{i}")
        params = {"$ref": f"#/$defs/f{i}"}
    return {
        "type": "object",
        "properties": {"name": {"const": f.name}, key: params},
        "required": ["name", key],
        "additionalProperties": False,
    }


def _any_envelope(functions: Sequence[Function], key: str) -> dict[str, Any]:
    """One schema for a call to any of `functions`. A function's parameters that use `$ref`
    (pydantic's nested models: `#/$defs/...`) move whole under the envelope's `$defs`, their
    refs rewritten to reach them there (from the envelope's root they would find nothing)."""
    defs: dict[str, Any] = {}
    envelopes = [_envelope(f, key, defs, i) for i, f in enumerate(functions)]
    out = envelopes[0] if len(envelopes) == 1 else {"anyOf": envelopes}
    return {**out, "$defs": defs} if defs else out


def _has_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        return "$ref" in schema or any(_has_ref(v) for v in schema.values())
    return isinstance(schema, list) and any(_has_ref(v) for v in schema)


def _rerooted(schema: Any, root: str) -> Any:
    """`schema` with each local `$ref` ("#", "#/...") made to start at `root` instead."""
    if isinstance(schema, list):
        return [_rerooted(v, root) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rerooted(v, root) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = root + ref[1:]
    return out


def closed(schema: Any) -> Any:
    """`schema` with each object that lists its properties, and says nothing of others, closed
    to others: generated arguments hold only declared properties (a small model copies the
    schema's own keywords in as arguments otherwise), and still match the schema as given,
    which allows a superset. An object whose `properties` stand beside a combiner (`allOf`,
    `anyOf`, `oneOf`, `$ref`, a conditional) is left open, and so are that combiner's parts:
    each adds properties the other does not list (a discriminated union)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    combined = "properties" in schema and bool(_COMBINERS & schema.keys())
    out = {
        k: closed(v) if k in _SUBSCHEMAS and not (combined and k in _COMBINERS) else v
        for k, v in schema.items()
    }
    for k in _SCHEMA_MAPS:
        if isinstance(schema.get(k), dict):
            out[k] = {name: closed(s) for name, s in schema[k].items()}
    if "properties" in schema and not _OPEN_KEYS & schema.keys() and not combined:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = frozenset({"items", "anyOf", "oneOf", "prefixItems"})
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_OPEN_KEYS = frozenset({"additionalProperties", "patternProperties", "unevaluatedProperties"})
# Keywords whose parts may add properties to an object that lists its own beside them.
_COMBINERS = frozenset(
    {"allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "dependentSchemas", "not"}
)


def _json(schema: dict[str, Any]) -> str:
    """An inline schema, generated as every constraint's JSON is (no free whitespace)."""
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def _literal(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)
