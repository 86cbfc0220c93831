"""Llama 3.1/3.2 JSON tool calls, as their chat templates ask for them:

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": ..., "parameters": ...}; {"name": ..., "parameters": ...}

An envelope (envelope.py; "parameters" or "arguments") or a list of them, where the output
begins (after whitespace), or anywhere after `<|python_tag|>` (when the detokenizer keeps it).
Further envelopes may follow, separated by `;` or whitespace; the calls end at the first text
that is not one, and that text is content. JSON elsewhere in an answer is not a call.

There is no closing marker, so the region (stream.py) is the whole run of envelopes, and a
malformed one leaves the rest of the output as content. An object at the start that is not a
call (no name: an answer in JSON) is content too, but only once it is complete, since until
then it might still be a call.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto

from pdserve.frontend.tool_calls.call import Malformed
from pdserve.frontend.tool_calls.envelope import EnvelopeReader
from pdserve.frontend.tool_calls.stream import StreamParser

PYTHON_TAG = "<|python_tag|>"


class _State(Enum):
    START = auto()  # nothing but whitespace yet: a call may begin here
    CONTENT = auto()
    TAGGED = auto()  # after <|python_tag|>: a call must follow
    JSON = auto()
    BETWEEN = auto()  # after an envelope: ';', another one, or the end of the calls
    SEPARATED = auto()  # after ';': another envelope, or the end of the calls


class Llama3Json(StreamParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        super().__init__(new_id)
        self._state = _State.START
        self._reader: EnvelopeReader | None = None
        self._calls_end = 0  # where the last envelope ended

    def _step(self) -> bool:
        match self._state:
            case _State.START:
                if not self._skip_space(as_content=True):
                    return False
                if self._text[self._pos] in "{[":
                    self._begin_region()
                    self._open_json()
                else:
                    self._state = _State.CONTENT
                return True
            case _State.CONTENT:
                if self._content_until((PYTHON_TAG,)) is None:
                    return False
                self._begin_region()
                self._pos += len(PYTHON_TAG)
                self._state = _State.TAGGED
                return True
            case _State.TAGGED:
                if not self._skip_space():
                    return False
                if self._text[self._pos] not in "{[":
                    raise Malformed(f"{PYTHON_TAG} not followed by a JSON call")
                self._open_json()
                return True
            case _State.JSON:
                assert self._reader is not None  # set on entering JSON
                if not self._feed_json(self._reader):
                    return False
                self._calls_end = self._pos
                self._state = _State.BETWEEN
                return True
            case _State.BETWEEN | _State.SEPARATED:
                if not self._skip_space():
                    return False
                c = self._text[self._pos]
                if c in "{[":
                    self._open_json()
                elif c == ";" and self._state is _State.BETWEEN:
                    self._pos += 1
                    self._state = _State.SEPARATED
                else:  # the calls are over: what follows them is content
                    self._pos = self._calls_end
                    self._end_region()
                    self._state = _State.CONTENT
                return True
        raise AssertionError(self._state)

    def _open_json(self) -> None:
        self._reader = EnvelopeReader(self)
        self._state = _State.JSON

    def _close_at_end(self) -> None:
        if self._state in (_State.BETWEEN, _State.SEPARATED):  # only whitespace is left
            self._pos = len(self._text)
            self._end_region()
            self._state = _State.CONTENT

    def _resume(self) -> None:
        self._state = _State.CONTENT
