"""A JSON request body's bytes -> its value, refusing what no JSON endpoint can take (400).

`parse_json_body` is the OpenAI API's (Python's json, then a walk for depth and lone
surrogates); `utf8_body` gives a typed decoder that reads only UTF-8 (the worker's /generate,
protocol/generate.py) the body in UTF-8, from whatever charset its Content-Type declares, with
the same messages for a charset neither can read.
"""

from __future__ import annotations

import codecs
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
    text = _text(raw, charset or "utf-8")
    try:
        value = json.loads(text)
    except RecursionError as e:
        raise bad(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from e
    except ValueError as e:  # JSONDecodeError, or an int past Python's int-digit limit
        raise bad(f"the request body is not valid JSON: {e}") from e
    check_json(value)
    return value


def utf8_body(raw: bytes, charset: str | None) -> bytes:
    """A body's bytes in UTF-8: as they came if the charset is UTF-8's or none (JSON's own; the
    decoder checks the bytes), else decoded from the charset and encoded again; 400 if they
    cannot be."""
    if charset is None or is_utf8(charset):
        return raw
    text = _text(raw, charset)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate, which some codecs decode to
        raise bad(_surrogate_message(text[e.start])) from e


def is_utf8(charset: str) -> bool:
    """Whether a Content-Type charset names UTF-8 ("utf-8", "UTF8", "U8", ...)."""
    try:
        return codecs.lookup(charset).name == "utf-8"
    except LookupError:
        return False


def _text(raw: bytes, encoding: str) -> str:
    try:
        return raw.decode(encoding)
    except LookupError as e:  # also a codec that is not a text encoding ("hex", "rot13")
        raise bad(f"unsupported charset {show(encoding)} in Content-Type; send UTF-8") from e
    except UnicodeError as e:
        raise bad(f"the request body is not valid JSON in {show(encoding)}: {e}") from e


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
        raise bad(_surrogate_message(s[e.start]), param) from e


def _surrogate_message(char: str) -> str:
    return f"a string holds a lone surrogate (U+{ord(char):04X}), which is not text"
