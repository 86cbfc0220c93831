"""DeepSeek-V3 (and R1) tool calls, written in the model's own tokens, as its chat template
renders an assistant's calls:

    text<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(`｜` is U+FF5C, `▁` U+2581.) Each call is its type, the separator, the function name, and
its arguments in a ```json fence. DeepSeek-V3.1's form, the name before the separator and the
bare arguments after it (`<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
<｜tool▁call▁end｜>`), is read too: a `{` right after the separator says which.

The block from `<｜tool▁calls▁begin｜>` to `<｜tool▁calls▁end｜>` is one region (stream.py): a
malformed call makes the block content through its end. An output that ends after a complete
call without `<｜tool▁calls▁end｜>` (or inside it) keeps its calls.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto

from pdserve.frontend.tool_calls.call import Malformed
from pdserve.frontend.tool_calls.json_scan import JsonScanner
from pdserve.frontend.tool_calls.stream import StreamParser

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE_OPEN = "```json"
FENCE_CLOSE = "```"
WORD_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


class _State(Enum):
    CONTENT = auto()
    BLOCK = auto()  # between calls: the next one, or the end of the block
    TYPE = auto()  # the word before the separator (V3: the type; V3.1: the name)
    AFTER_SEP = auto()  # V3.1's arguments, or V3's name
    NAME = auto()  # V3: the name, up to a newline
    FENCE = auto()  # V3: ```json
    ARGS_OPEN = auto()  # the arguments object must follow
    ARGS = auto()
    FENCE_CLOSE = auto()  # V3: ```
    CALL_CLOSE = auto()  # <｜tool▁call▁end｜>


class DeepSeekV3(StreamParser):
    name = "deepseek_v3"
    region_end = CALLS_END
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        super().__init__(new_id)
        self._state = _State.CONTENT
        self._word_start = 0  # where the word being read began
        self._word = ""  # the word before the separator
        self._fenced = False  # V3: the arguments sit in a ```json fence
        self._args: JsonScanner | None = None

    def _step(self) -> bool:
        s = self._state
        if s is _State.CONTENT:
            if self._content_until((CALLS_BEGIN,)) is None:
                return False
            self._begin_region()
            self._pos += len(CALLS_BEGIN)
            self._state = _State.BLOCK
            return True
        if s is _State.TYPE or s is _State.NAME:
            return self._read_word()
        if s is _State.AFTER_SEP:
            if self._pos == len(self._text):
                return False
            self._fenced = self._text[self._pos] != "{"
            if self._fenced:  # V3: the word was the type; the name follows
                self._word_start = self._pos
                self._state = _State.NAME
            else:  # V3.1: the word was the name
                self.call_name(self._word)
                self._state = _State.ARGS_OPEN
            return True
        if s is _State.ARGS:
            assert self._args is not None  # set on entering ARGS
            if not self._feed_args(self._args):
                return False
            self._state = _State.FENCE_CLOSE if self._fenced else _State.CALL_CLOSE
            return True
        if not self._skip_space():
            return False
        if s is _State.ARGS_OPEN:
            if self._text[self._pos] != "{":
                raise Malformed("a tool call's arguments are not an object")
            self._args = JsonScanner()
            self._state = _State.ARGS
            return True
        if s is _State.BLOCK:
            return self._between_calls()
        marker, then = {
            _State.FENCE: (FENCE_OPEN, _State.ARGS_OPEN),
            _State.FENCE_CLOSE: (FENCE_CLOSE, _State.CALL_CLOSE),
            _State.CALL_CLOSE: (CALL_END, _State.BLOCK),
        }[s]
        return self._expect(marker, then)

    def _between_calls(self) -> bool:
        call, end = self._look(CALL_BEGIN), self._look(CALLS_END)
        if call:
            self._pos += len(CALL_BEGIN)
            self.begin_call()
            self._word_start = self._pos
            self._state = _State.TYPE
            return True
        if end:
            self._pos += len(CALLS_END)
            self._end_region()
            self._state = _State.CONTENT
            return True
        if call is None or end is None:
            return False
        raise Malformed(f"neither {CALL_BEGIN} nor {CALLS_END}")

    def _expect(self, marker: str, then: _State) -> bool:
        seen = self._look(marker)
        if seen is None:
            return False
        if not seen:
            raise Malformed(f"expected {marker}")
        self._pos += len(marker)
        if marker == CALL_END:
            self.end_call()
        self._state = then
        return True

    def _read_word(self) -> bool:
        """The type (or V3.1's name) up to the separator, or V3's name up to a newline."""
        text, typing = self._text, self._state is _State.TYPE
        while self._pos < len(text):
            c = text[self._pos]
            if c in WORD_CHARS:
                self._pos += 1
                continue
            word = text[self._word_start : self._pos]
            if not word:
                raise Malformed("an empty name in a tool call")
            if not typing:
                if c != "\n":
                    raise Malformed(f"{c!r} in a function name")
                self.call_name(word)
                self._pos += 1
                self._state = _State.FENCE
                return True
            seen = self._look(SEP)
            if seen is None:
                return False
            if not seen:
                raise Malformed(f"{c!r} before {SEP}")
            self._word = word
            self._pos += len(SEP)
            self._state = _State.AFTER_SEP
            return True
        return False

    def _close_at_end(self) -> None:
        if self._state is _State.BLOCK and CALLS_END.startswith(self._text[self._pos :]):
            self._pos = len(self._text)
            self._end_region()
            self._state = _State.CONTENT

    def _resume(self) -> None:
        self._state = _State.CONTENT
