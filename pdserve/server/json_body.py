"""A JSON request body's bytes -> its value, refusing what no JSON endpoint can take (400).
Shared by the OpenAI API and the worker API."""

from __future__ import annotations

import json
from typing import Any

from pdserve.protocol.sampling import show
from pdserve.server.api_error import bad

MAX_JSON_DEPTH = 64


def parse_json_body(raw: bytes, charset: str | None) -> Any:
    """A request body's bytes -> its JSON value; a body no JSON endpoint can take is a 400.

    Python's json accepts what later code cannot: nesting deep enough to exhaust the stack
    (RecursionError), ints past the int-digit limit (ValueError), lone surrogates (they fail
    UTF-8 encoding in the tokenizer or in the response). NaN and Infinity do parse: the
    field checks refuse them and name the field.
    """
    encoding = charset or "utf-8"
    try:
        text = raw.decode(encoding)
    except LookupError as e:  # also a codec that is not a text encoding ("hex", "rot13")
        raise bad(f"unsupported charset {show(charset)} in Content-Type; send UTF-8") from e
    except UnicodeError as e:
        raise bad(f"the request body is not valid JSON in {show(encoding)}: {e}") from e
    try:
        value = json.loads(text)
    except RecursionError as e:
        raise bad(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from e
    except ValueError as e:  # JSONDecodeError, or an int past Python's int-digit limit
        raise bad(f"the request body is not valid JSON: {e}") from e
    check_json(value)
    return value


def check_json(value: Any) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and a lone surrogate in any string or key.

    The error names the top-level field the problem sits under.
    """
    stack: list[tuple[Any, int, str | None]] = [(value, 0, None)]
    while stack:
        v, depth, top = stack.pop()
        if isinstance(v, str):
            _check_text(v, top)
            continue
        if not isinstance(v, (dict, list)):
            continue  # a number, a bool or null: only the top-level value gets here
        if depth >= MAX_JSON_DEPTH:
            raise bad(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", top)
        if isinstance(v, dict):
            for k, x in v.items():
                _check_text(k, top)
                if isinstance(x, (str, list, dict)):
                    stack.append((x, depth + 1, k if depth == 0 else top))
        else:
            stack.extend((x, depth + 1, top) for x in v if isinstance(x, (str, list, dict)))


def _check_text(s: str, param: str | None) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(
            f"a string holds a lone surrogate (U+{ord(s[e.start]):04X}), which is not text",
            param,
        ) from e
