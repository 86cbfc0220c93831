"""Mistral tool calls, in both of the forms its tokenizers give them:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (to v7)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]other[ARGS]{...}      (v11 on)

After `[TOOL_CALLS]`: a list of envelopes or one envelope (envelope.py); or a function name,
`[ARGS]` (or nothing, where the detokenizer dropped it) and the arguments object. Each
`[TOOL_CALLS]` opens a region (stream.py) of its own; nothing closes one, so a malformed one
leaves the rest of the output as content. `[TOOL_CALLS]` is a control token: the detokenizer
must keep it in the text (skip_special_tokens off) for calls to be seen at all.

Ids are nine letters and digits: Mistral's chat templates refuse any other id when a call
comes back in the next turn's messages.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto

from pdserve.frontend.tool_calls.call import Malformed, new_mistral_call_id
from pdserve.frontend.tool_calls.envelope import EnvelopeReader
from pdserve.frontend.tool_calls.json_scan import JsonScanner
from pdserve.frontend.tool_calls.stream import StreamParser

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


class _State(Enum):
    CONTENT = auto()
    OPENED = auto()  # after [TOOL_CALLS]
    JSON = auto()  # a list of envelopes, or one
    NAME = auto()  # a function name, up to [ARGS] or {
    ARGS_OPEN = auto()  # after [ARGS]: the arguments object must follow
    ARGS = auto()


class Mistral(StreamParser):
    name = "mistral"
    markers = (TOOL_CALLS, ARGS)

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        super().__init__(new_id)
        self._state = _State.CONTENT
        self._reader: EnvelopeReader | None = None
        self._args: JsonScanner | None = None
        self._name_start = 0

    def _make_id(self) -> str:
        return new_mistral_call_id()

    def _step(self) -> bool:
        match self._state:
            case _State.CONTENT:
                if self._content_until((TOOL_CALLS,)) is None:
                    return False
                self._begin_region()
                self._pos += len(TOOL_CALLS)
                self._state = _State.OPENED
                return True
            case _State.OPENED:
                if not self._skip_space():
                    return False
                if self._text[self._pos] in "{[":
                    self._reader = EnvelopeReader(self)
                    self._state = _State.JSON
                else:
                    self.begin_call()
                    self._name_start = self._pos
                    self._state = _State.NAME
                return True
            case _State.JSON:
                assert self._reader is not None  # set on entering JSON
                if not self._feed_json(self._reader):
                    return False
                self._end_region()
                self._state = _State.CONTENT
                return True
            case _State.NAME:
                return self._read_name()
            case _State.ARGS_OPEN:
                if not self._skip_space():
                    return False
                if self._text[self._pos] != "{":
                    raise Malformed(f"{ARGS} not followed by an object")
                self._open_args()
                return True
            case _State.ARGS:
                assert self._args is not None  # set on entering ARGS
                if not self._feed_args(self._args):
                    return False
                self.end_call()
                self._end_region()
                self._state = _State.CONTENT
                return True
        raise AssertionError(self._state)

    def _read_name(self) -> bool:
        text = self._text
        while self._pos < len(text):
            c = text[self._pos]
            if c == "{":
                self.call_name(text[self._name_start : self._pos])
                self._open_args()
                return True
            if c == "[":
                marker = self._look(ARGS)
                if marker is None:
                    return False
                if not marker:
                    raise Malformed(f"[ in a function name, not {ARGS}")
                self.call_name(text[self._name_start : self._pos])
                self._pos += len(ARGS)
                self._state = _State.ARGS_OPEN
                return True
            if c not in NAME_CHARS:
                raise Malformed(f"{c!r} in a function name")
            self._pos += 1
        return False

    def _open_args(self) -> None:
        self._args = JsonScanner()
        self._state = _State.ARGS

    def _close_at_end(self) -> None:
        pass  # a call is complete only once its JSON is, and then its region has ended

    def _resume(self) -> None:
        self._state = _State.CONTENT
