"""Structured output: the request fields that constrain the output -> one Constraint, or none.

The fields, honoured by both endpoints (chat and completions):
- OpenAI's `response_format`: {"type": "text"} (no constraint), {"type": "json_object"}, or
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}: the
  schema is enforced whatever `strict` says (as in vLLM);
- vLLM's `structured_outputs`: an object with one of `json` (a schema, as an object or as
  JSON text), `regex`, `choice` (a list of strings), `grammar` (Lark or GBNF text) or
  `json_object` (true); a key set to null (or json_object false) is absent, and any other
  key (a backend's tuning) is refused;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`.

A request asks for at most one constraint: a second is a 400 naming it, as is a malformed
field or a schema sent as JSON text that nests deeper than the body may (MAX_JSON_DEPTH).
Two steps, as compiling may take up to the grammar thread's bound:
- `find_constraint`, on the event loop: the fields -> an `AskedConstraint` (the field it came
  in, kind and spec), not yet compiled;
- `build_constraint`, on the constraint threads (frontend/constraint_threads.py), never on the
  loop: the Constraint, compiled (protocol/constraint.py; `check_constraint`: a GBNF grammar
  converted in the converter's child process, runtime/gbnf_converter.py, as the engine does).
  A spec that cannot compile is a 400 naming the field it came in
  (`response_format.json_schema.schema`, `structured_outputs.regex`, `guided_json`), with the
  grammar engine's reason.
Raises InvalidParams; torch-free.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from pdserve.protocol.constraint import Constraint, ConstraintKind
from pdserve.protocol.invalid_params import InvalidParams, show
from pdserve.runtime.gbnf_converter import GBNF_CONVERTER
from pdserve.server.json_body import MAX_JSON_DEPTH

GUIDED = {
    "guided_json": ConstraintKind.JSON_SCHEMA,
    "guided_regex": ConstraintKind.REGEX,
    "guided_choice": ConstraintKind.CHOICE,
    "guided_grammar": ConstraintKind.GRAMMAR,
}
_STRUCTURED_KEYS = {
    "json": ConstraintKind.JSON_SCHEMA,
    "regex": ConstraintKind.REGEX,
    "choice": ConstraintKind.CHOICE,
    "grammar": ConstraintKind.GRAMMAR,
    "json_object": ConstraintKind.JSON_OBJECT,
}
_JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})
# Every field that may carry a constraint (frontend/fields.py honours them).
STRUCTURED_FIELDS = frozenset({"response_format", "structured_outputs", *GUIDED})

_Found = tuple[str, ConstraintKind, str]  # (the field as the client wrote it, kind, spec)


class AskedConstraint(NamedTuple):
    """An output constraint as a request asks for it, not yet compiled: `build_constraint`
    makes it a Constraint. Its refusals name `field` and start with `context`."""

    field: str  # the body field it came in (its errors' param), or "tools" for forced calls
    kind: ConstraintKind
    spec: str
    context: str = ""  # what the grammar engine's reason follows in a refusal's message

    def refusal(self, e: InvalidParams) -> InvalidParams:
        """`e` (a refusal naming `constraint`) as this request's: naming `field`."""
        return InvalidParams(f"'{self.field}': {self.context}{e}", self.field)


def build_constraint(asked: AskedConstraint) -> Constraint:
    """The Constraint, checked and compiled: blocks until the grammar thread is done, so
    never call it on an event loop (ConstraintThreads.build runs it off the loop)."""
    try:
        c = Constraint(kind=asked.kind, spec=asked.spec)
        check_constraint(c)
        return c
    except InvalidParams as e:
        raise asked.refusal(e) from None


def check_constraint(c: Constraint) -> None:
    """`c.check_compiles()` as the sides facing a client make it (the front end, D's
    /generate): a GBNF grammar converted in the converter's child process, so the conversion
    never holds this process's GIL. Blocks: never on an event loop."""
    c.check_compiles(GBNF_CONVERTER.convert)


def find_constraint(body: dict[str, Any]) -> AskedConstraint | None:
    """The body's one output constraint, its fields checked but not compiled; None if it
    asks for none."""
    found: list[_Found] = []
    if body.get("response_format") is not None:
        found += _response_format(body["response_format"])
    if body.get("structured_outputs") is not None:
        found += _structured_outputs(body["structured_outputs"])
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, kind, _spec(name, kind, body[name])))
    if not found:
        return None
    if len(found) > 1:
        raise InvalidParams(
            f"'{found[1][0]}' is a second output constraint besides '{found[0][0]}'; a "
            "request may have one",
            found[1][0],
        )
    return AskedConstraint(*found[0])


def _response_format(rf: object) -> list[_Found]:
    where = "response_format"
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return []
    if kind == "json_object":
        return [(where, ConstraintKind.JSON_OBJECT, "")]
    if kind != "json_schema" or not isinstance(rf, dict):
        raise InvalidParams(
            '\'response_format\' must be {"type": "text"}, {"type": "json_object"} or '
            f'{{"type": "json_schema", "json_schema": {{...}}}}, got {show(rf)}',
            where,
        )
    js = rf.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(js, dict):
        raise InvalidParams(f"'{where}' must be an object, got {show(js)}", where)
    unknown = sorted(str(k) for k in js if k not in _JSON_SCHEMA_KEYS)
    if unknown:
        raise InvalidParams(f"'{where}' has an unknown field {show(unknown[0])}", where)
    for name, types in (("name", str), ("description", str), ("strict", bool)):
        if js.get(name) is not None and not isinstance(js[name], types):
            raise InvalidParams(
                f"'{where}.{name}' must be a {types.__name__}, got {show(js[name])}",
                f"{where}.{name}",
            )
    if "schema" not in js:
        raise InvalidParams(f"'{where}.schema' is required", f"{where}.schema")
    where += ".schema"
    return [
        (where, ConstraintKind.JSON_SCHEMA, _spec(where, ConstraintKind.JSON_SCHEMA, js["schema"]))
    ]


def _structured_outputs(so: object) -> list[_Found]:
    if not isinstance(so, dict):
        raise InvalidParams(
            f"'structured_outputs' must be an object, got {show(so)}", "structured_outputs"
        )
    found: list[_Found] = []
    for key, value in so.items():
        where = f"structured_outputs.{key}"
        if value is None or (key == "json_object" and value is False):
            continue
        kind = _STRUCTURED_KEYS.get(key)
        if kind is None:
            raise InvalidParams(
                f"'{where}' is not supported; give one of {', '.join(_STRUCTURED_KEYS)}",
                where,
            )
        found.append((where, kind, _spec(where, kind, value)))
    return found


def _spec(where: str, kind: ConstraintKind, v: object) -> str:
    """A field's value as the constraint's spec text (protocol/constraint.py)."""
    match kind:
        case ConstraintKind.JSON_SCHEMA:
            if isinstance(v, str):  # JSON text, as vLLM takes it too
                v = _json_text(where, v)
            if not isinstance(v, dict | bool):
                raise InvalidParams(
                    f"'{where}' must be a JSON schema (an object), got {show(v)}", where
                )
            return json.dumps(v, ensure_ascii=False)
        case ConstraintKind.JSON_OBJECT:
            if v is not True:
                raise InvalidParams(f"'{where}' must be true, got {show(v)}", where)
            return ""
        case ConstraintKind.CHOICE:
            if not (isinstance(v, list) and v and all(isinstance(c, str) and c for c in v)):
                raise InvalidParams(
                    f"'{where}' must be a non-empty list of non-empty strings, got {show(v)}",
                    where,
                )
            return json.dumps(v, ensure_ascii=False)
    if not (isinstance(v, str) and v):
        raise InvalidParams(f"'{where}' must be a non-empty string, got {show(v)}", where)
    return v


def _json_text(where: str, text: str) -> Any:
    """A field's JSON text -> its value, nested at most MAX_JSON_DEPTH deep as the body itself
    is (server/json_body.py): deeper, Python's json raises RecursionError, and a value just
    within its limit would raise it again when dumped."""
    deep = InvalidParams(f"'{where}' nests deeper than {MAX_JSON_DEPTH} levels", where)
    try:
        value = json.loads(text)
    except RecursionError:
        raise deep from None
    except ValueError as e:  # JSONDecodeError, or an int past Python's int-digit limit
        raise InvalidParams(f"'{where}' is not JSON: {e}", where) from None
    if _depth_exceeds(value, MAX_JSON_DEPTH):
        raise deep
    return value


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether `value` nests objects or arrays more than `limit` deep (without recursing)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth >= limit:
                return True
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False
