"""A JSON syntax checker fed one character at a time, for tool calls that stream.

`JsonScanner` takes the characters of one JSON object or array (a tool call's envelope or its
arguments; a scalar is refused at the top) and says, for each, what it is (`Kind`) and at
which level: the number of containers around it, not counting one it opens or closes. So in
`{"a": [1]}` the outer braces are at level 0, `"a"`, `:` and the brackets at level 1, and `1`
at level 2. The first character that cannot continue a valid value raises `JsonError` (a
`Malformed`); `done` turns true on the character that closes the top-level value, exactly
when `json.loads` would accept what was fed.

Invariant: every character fed before `done` or the error is a prefix of some valid JSON
text, so what a parser streams of it can still be completed into valid arguments.
"""

from __future__ import annotations

from enum import Enum, auto

from pdserve.frontend.tool_calls.call import Malformed

_SPACE = " \t\n\r"
_ESCAPES = '"\\/bfnrt'
_HEX = "0123456789abcdefABCDEF"
_DIGITS = "0123456789"
_LITERALS = {"t": "true", "f": "false", "n": "null"}


class JsonError(Malformed):
    """Not valid JSON: the character, where, and why."""


class Kind(Enum):
    OPEN = auto()  # { or [
    CLOSE = auto()  # } or ]
    KEY = auto()  # a character of an object key, its quotes included
    STRING = auto()  # a character of a string value, its quotes included
    SCALAR = auto()  # a character of a number, true, false or null
    COLON = auto()
    COMMA = auto()
    SPACE = auto()


class _Want(Enum):
    VALUE = auto()  # a value (at the top: an object or an array)
    FIRST_KEY = auto()  # after {: a key or }
    KEY = auto()  # after , in an object
    COLON = auto()
    FIRST_ITEM = auto()  # after [: a value or ]
    NEXT = auto()  # after a value: , or the close of its container


class _Number(Enum):  # where a number is: -? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?
    SIGN = auto()
    ZERO = auto()
    INT = auto()
    DOT = auto()
    FRAC = auto()
    E = auto()
    E_SIGN = auto()
    EXP = auto()


_NUMBER_ENDS = frozenset({_Number.ZERO, _Number.INT, _Number.FRAC, _Number.EXP})


class JsonScanner:
    def __init__(self) -> None:
        self.done = False
        self._stack: list[str] = []  # the open containers' closing characters
        self._want = _Want.VALUE
        self._string: Kind | None = None  # inside a KEY or STRING
        self._escape = 0  # 1: after a backslash; 2-5: inside \\uXXXX, that many hex to go
        self._literal = ""  # the rest of true/false/null still to come
        self._number: _Number | None = None
        self._seen = 0  # characters fed

    @property
    def level(self) -> int:
        return len(self._stack)

    @property
    def in_string(self) -> bool:
        """Inside a key or a string: after its opening quote, before its closing one."""
        return self._string is not None

    def feed(self, c: str) -> tuple[Kind, int]:
        """What `c` is and at which level; JsonError if it cannot continue the value."""
        if self.done:
            raise self._error(c, "the value is complete")
        self._seen += 1
        if self._string is not None:
            return self._in_string(c)
        if self._literal:
            if c != self._literal[0]:
                raise self._error(c, f"expected {self._literal[0]!r}")
            self._literal = self._literal[1:]
            if not self._literal:
                self._want = _Want.NEXT
            return Kind.SCALAR, self.level
        if self._number is not None:
            if self._number_continues(c):
                return Kind.SCALAR, self.level
            if self._number not in _NUMBER_ENDS:
                raise self._error(c, "a number is cut short")
            self._number = None
            self._want = _Want.NEXT
        return self._structural(c)

    def _structural(self, c: str) -> tuple[Kind, int]:
        level, want = self.level, self._want
        if c in _SPACE:
            return Kind.SPACE, level
        if want in (_Want.FIRST_KEY, _Want.KEY) and c == '"':
            self._string = Kind.KEY
            return Kind.KEY, level
        if want is _Want.COLON and c == ":":
            self._want = _Want.VALUE
            return Kind.COLON, level
        if c in "}]" and (
            (want is _Want.FIRST_KEY and c == "}")
            or (want is _Want.FIRST_ITEM and c == "]")
            or (want is _Want.NEXT and self._stack and self._stack[-1] == c)
        ):
            self._stack.pop()
            self._want = _Want.NEXT
            self.done = not self._stack
            return Kind.CLOSE, self.level
        if want is _Want.NEXT and c == "," and self._stack:
            self._want = _Want.KEY if self._stack[-1] == "}" else _Want.VALUE
            return Kind.COMMA, level
        if want in (_Want.VALUE, _Want.FIRST_ITEM):
            return self._value(c, level)
        raise self._error(c, f"expected {_EXPECTED[want]}")

    def _value(self, c: str, level: int) -> tuple[Kind, int]:
        if c in "{[":
            self._stack.append("}" if c == "{" else "]")
            self._want = _Want.FIRST_KEY if c == "{" else _Want.FIRST_ITEM
            return Kind.OPEN, level
        if not self._stack:
            raise self._error(c, "a tool call is an object or a list")
        if c == '"':
            self._string = Kind.STRING
            return Kind.STRING, level
        if c in _LITERALS:
            self._literal = _LITERALS[c][1:]
            return Kind.SCALAR, level
        if c == "-" or c in _DIGITS:
            self._number = _Number.SIGN if c == "-" else _Number.ZERO if c == "0" else _Number.INT
            return Kind.SCALAR, level
        raise self._error(c, "expected a value")

    def _in_string(self, c: str) -> tuple[Kind, int]:
        kind = self._string
        assert kind is not None  # only called inside a string
        if self._escape == 1:
            if c == "u":
                self._escape = 5
            elif c in _ESCAPES:
                self._escape = 0
            else:
                raise self._error(c, "not an escape")
        elif self._escape > 1:
            if c not in _HEX:
                raise self._error(c, "expected a hex digit of \\u")
            self._escape = 0 if self._escape == 2 else self._escape - 1
        elif c == "\\":
            self._escape = 1
        elif c == '"':
            self._string = None
            self._want = _Want.COLON if kind is Kind.KEY else _Want.NEXT
        elif c < " ":
            raise self._error(c, "a control character inside a string")
        return kind, self.level

    def _number_continues(self, c: str) -> bool:
        n = self._number
        assert n is not None  # only called while a number is read
        nxt: _Number | None = None
        if c in _DIGITS:
            nxt = {
                _Number.SIGN: _Number.ZERO if c == "0" else _Number.INT,
                _Number.INT: _Number.INT,
                _Number.DOT: _Number.FRAC,
                _Number.FRAC: _Number.FRAC,
                _Number.E: _Number.EXP,
                _Number.E_SIGN: _Number.EXP,
                _Number.EXP: _Number.EXP,
            }.get(n)
        elif c == "." and n in (_Number.ZERO, _Number.INT):
            nxt = _Number.DOT
        elif c in "eE" and n in (_Number.ZERO, _Number.INT, _Number.FRAC):
            nxt = _Number.E
        elif c in "+-" and n is _Number.E:
            nxt = _Number.E_SIGN
        if nxt is None:
            return False
        self._number = nxt
        return True

    def _error(self, c: str, why: str) -> JsonError:
        return JsonError(f"invalid JSON at character {self._seen} ({c!r}): {why}")


_EXPECTED = {
    _Want.VALUE: "a value",
    _Want.FIRST_KEY: "a key or }",
    _Want.KEY: "a key",
    _Want.COLON: ":",
    _Want.FIRST_ITEM: "a value or ]",
    _Want.NEXT: ", or the end of the container",
}
