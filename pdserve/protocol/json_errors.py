"""msgspec's refusal of a JSON body -> InvalidParams: what is wrong, naming the field.

A typed msgspec decoder refuses a body in one of three ways, and each becomes one message:

* a value of the wrong type or out of range: a ValidationError whose text ends in the value's
  path ("Expected `int`, got `bool` - at `$.prompt_ids[3]`");
* a check a struct's `__post_init__` raised (SamplingParams'): that ValidationError's cause,
  an InvalidParams that already names its field, used as it is;
* bytes that are not JSON: a DecodeError, with the byte where reading stopped when msgspec
  knows it. The path at that byte is read from the body before it (msgspec read that much as
  JSON). JSON has no NaN or Infinity, and a lone UTF-16 surrogate escape is not text: both
  get a message of their own.

The field named (`param`) is the innermost object key on the path: `$.prompt_ids[3]` names
prompt_ids, `$.params.seed` seed, as SamplingParams' own checks name theirs; an unknown or
missing top-level field is named by its key.
"""

from __future__ import annotations

import re

import msgspec

from pdserve.protocol.sampling import InvalidParams

_AT_PATH = re.compile(r" - at `(\$[^`]*)`$")
_PATH_KEY = re.compile(r"\.([^.\[]+)")
_FIELD_NAMED = re.compile(r"(?:unknown|missing required) field `([^`]*)`")
_AT_BYTE = re.compile(r"\(byte (\d+)\)$")
# A JSON string with its escapes blanked out (one left open at the end counts: the offset may
# fall inside it), a structural character, or a run of anything else (numbers, commas,
# literals): one token for a whole array of numbers, so a long prompt costs one regex scan.
_TOKEN = re.compile(rb'"[^"]*(?:"|\Z)|[{}\[\]:]|[^"{}\[\]:]+')
# The path is not followed through more tokens than this: the fault is then named without a
# field. Only a hostile body has that many before its fault (thousands of repeated keys).
MAX_PATH_TOKENS = 10_000
# msgspec reads the 6 bytes after a high surrogate's escape for its low half; with fewer
# left it says "truncated": a high surrogate's escape that near the end is the real fault.
_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}")
_NOT_NUMBERS = (b"NaN", b"Infinity")


def explain(raw: bytes, error: msgspec.DecodeError) -> InvalidParams:
    """The client's fault in `raw`, which a typed msgspec decoder refused with `error` (a
    ValidationError is a DecodeError)."""
    if isinstance(error, msgspec.ValidationError):
        return _invalid(error)
    return _malformed(raw, str(error))


def _invalid(error: msgspec.ValidationError) -> InvalidParams:
    if isinstance(error.__cause__, InvalidParams):  # raised by a struct's __post_init__
        return error.__cause__
    message = str(error)
    path = _AT_PATH.search(message)
    if path is not None:
        keys = _PATH_KEY.findall(path[1])
        return InvalidParams(message, keys[-1] if keys else None)
    named = _FIELD_NAMED.search(message)
    return InvalidParams(message, named[1] if named else None)


def _malformed(raw: bytes, message: str) -> InvalidParams:
    at = _AT_BYTE.search(message)
    truncated = message == "Input data was truncated"
    high = _high_surrogate_at_end(raw) if truncated else None
    if at is not None:
        offset: int | None = int(at[1])
    elif high is not None:
        offset = high
    else:
        offset = len(raw) if truncated else None
    path = _path_at(raw, offset) if offset is not None else []
    keys = [p for p in path if isinstance(p, str)]
    field = keys[-1] if keys else None
    where = f" - at `{_render(path)}`" if path else ""
    if "surrogate" in message or high is not None:
        return InvalidParams(f"a string holds a lone UTF-16 surrogate, not text{where}", field)
    if offset is not None:
        token = next((t for t in _NOT_NUMBERS if raw.startswith(t, offset)), None)
        if token is not None:
            sign = "-" if token == b"Infinity" and raw[offset - 1 : offset] == b"-" else ""
            shown = sign + token.decode()
            return InvalidParams(f"{shown} is not a JSON number: send a finite one{where}", field)
    why = message.removeprefix("JSON is malformed: ")
    return InvalidParams(f"the request body is not valid JSON: {why}{where}", field)


def _high_surrogate_at_end(raw: bytes) -> int | None:
    """Where an escaped high surrogate starts in the last 11 bytes of `raw`, if one does."""
    for m in _HIGH_SURROGATE.finditer(raw, max(len(raw) - 11, 0)):
        head = raw[: m.start()]
        if (len(head) - len(head.rstrip(b"\\"))) % 2 == 0:  # its backslash is not escaped
            return m.start()
    return None


def _path_at(raw: bytes, offset: int) -> list[str | int]:
    """The path of the value being read at byte `offset` of `raw`, whose bytes before it are
    well-formed JSON: object keys and array indices, outermost first."""
    # Left to right, `\\` and then `\"` are each one escape: blanked, every quote left is a
    # string's own, and the offsets stay where they were.
    text = raw[:offset].replace(b"\\\\", b"__").replace(b'\\"', b"__")
    path: list[str | int | None] = []  # per open container: its key or index; None: no key yet
    last = b""
    for n, m in enumerate(_TOKEN.finditer(text)):
        if n == MAX_PATH_TOKENS:
            return []
        t = m[0]
        if t == b"{":
            path.append(None)
        elif t == b"[":
            path.append(0)
        elif t in (b"}", b"]"):
            if path:
                path.pop()
        elif t == b":":
            if path:
                path[-1] = _key(last)
        elif t.startswith(b'"'):
            last = t
        elif path and b"," in t:  # the next entry
            top = path[-1]
            path[-1] = top + t.count(b",") if isinstance(top, int) else None
    return [p for p in path if p is not None]


def _key(token: bytes) -> str:
    try:
        return msgspec.json.decode(token, type=str)
    except msgspec.DecodeError:
        return token.strip(b'"').decode("utf-8", "replace")


def _render(path: list[str | int]) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
