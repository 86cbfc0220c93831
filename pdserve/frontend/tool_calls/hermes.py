"""Hermes tool calls, as Qwen 2.5/3 (and NousResearch's Hermes) write them:

    text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": ..., "arguments": ...}
    </tool_call>

One `<tool_call>` block holds one envelope (envelope.py), or a list of them (as SmolLM2's
larger models write `<tool_call>[{...}, {...}]</tool_call>`), or several one after another.
A block is a region (stream.py): a malformed one is content through its `</tool_call>`, and
the blocks after it are read again. An output that ends after a complete envelope without
the closing tag (or inside it) still has its call.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto

from pdserve.frontend.tool_calls.call import Malformed
from pdserve.frontend.tool_calls.envelope import EnvelopeReader
from pdserve.frontend.tool_calls.stream import StreamParser

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class _State(Enum):
    CONTENT = auto()
    OPENED = auto()  # after <tool_call>: a call must follow
    JSON = auto()  # inside an envelope or a list of them
    AFTER = auto()  # after one: another, or </tool_call>


class Hermes(StreamParser):
    name = "hermes"
    region_end = CLOSE
    markers = (OPEN, CLOSE)

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        super().__init__(new_id)
        self._state = _State.CONTENT
        self._reader: EnvelopeReader | None = None

    def _step(self) -> bool:
        match self._state:
            case _State.CONTENT:
                if self._content_until((OPEN,)) is None:
                    return False
                self._begin_region()
                self._pos += len(OPEN)
                self._state = _State.OPENED
                return True
            case _State.OPENED | _State.AFTER:
                if not self._skip_space():
                    return False
                if self._text[self._pos] in "{[":
                    self._reader = EnvelopeReader(self)
                    self._state = _State.JSON
                    return True
                if self._state is _State.OPENED:
                    raise Malformed(f"{OPEN} not followed by a call")
                closed = self._look(CLOSE)
                if closed is None:
                    return False
                if not closed:
                    raise Malformed(f"text after a call, before {CLOSE}")
                self._pos += len(CLOSE)
                self._end_region()
                self._state = _State.CONTENT
                return True
            case _State.JSON:
                assert self._reader is not None  # set on entering JSON
                if not self._feed_json(self._reader):
                    return False
                self._state = _State.AFTER
                return True
        raise AssertionError(self._state)

    def _close_at_end(self) -> None:
        if self._state is _State.AFTER and CLOSE.startswith(self._text[self._pos :]):
            self._pos = len(self._text)
            self._end_region()
            self._state = _State.CONTENT

    def _resume(self) -> None:
        self._state = _State.CONTENT
