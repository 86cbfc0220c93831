"""The streaming tool-call parser every format derives from: text deltas in, typed deltas out.

`feed(text)` takes the next piece of generated text and returns the deltas it settles:
content while outside a call; for each call a `CallStart` (index, id, name), then
`ArgumentsDelta` fragments of its arguments. `finish()` ends the output. `parse(text)` is the
same machine fed the whole text at once, so a whole-text parse and any split of the same text
into deltas agree (tests/frontend/test_tool_calls*.py split every format at every character).

A format (hermes.py, ...) is a state machine over `self._text` from `self._pos`: its `_step`
advances as far as the text allows, and it reports what it reads through the sink verbs
`begin_call`, `call_name`, `call_args`, `end_call`. A *region* is the text of one block of
calls (`<tool_call>...</tool_call>`, `[TOOL_CALLS]...`); `Malformed` raised inside one fails it.

Invariants:
* Nothing is sent that might be taken back by more text: a tail that could begin a marker is
  held, and a call starts (its `CallStart`) only once its name is known and its arguments
  have begun with `{`, so a call's text that turns out not to be one is content.
* Deltas leave only when `feed` returns. A failed region none of whose calls had left is
  rolled back whole: its text is content, as if no marker had been seen (always so for
  `parse`). Once a call of it has left, that cannot be undone: the calls already sent stay
  (the one being read ends where it stands), and the region's text from the point of failure
  is content. Either way the region's text goes on as content up to its format's
  `region_end` (without one, to the end of the output), where reading resumes.
* Whitespace-only text beside a call (before it, between two, after the last) is not
  content; any other text outside calls is, verbatim.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from pdserve.frontend.tool_calls.call import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    Delta,
    Malformed,
    Parsed,
    assemble,
    new_call_id,
)
from pdserve.frontend.tool_calls.envelope import EnvelopeReader
from pdserve.frontend.tool_calls.json_scan import JsonScanner

MAX_NAME = 256  # characters of a function name


@dataclass
class _Segment:
    """The content since the last call (or the start): held while it is only whitespace."""

    held: str = ""  # whitespace not sent yet: all of the segment so far
    has_text: bool = False  # some of it was not whitespace, and has been sent
    after_call: bool = False  # it began where a call ended


@dataclass
class _Region:
    start: int  # where its text begins
    saved: _Segment  # the content state before it, for a rollback
    first_index: int  # the index its first call gets
    out_mark: int  # len(self._out) when it began (0 after a commit)
    committed: bool = False  # a call of it has left


@dataclass
class _Call:
    index: int
    name: str | None = None
    args_begun: bool = False
    pending_args: list[str] = field(default_factory=list)  # arguments before the start
    started: bool = False  # its CallStart was made
    start_at: int | None = None  # its CallStart's place in self._out, until it leaves


class StreamParser(ABC):
    name: ClassVar[str]  # as --tool-call-parser names it
    region_end: ClassVar[str | None] = None  # where a failed region's text ends
    markers: ClassVar[tuple[str, ...]] = ()  # the format's fixed strings (maybe special tokens)

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        """`new_id`: makes each call's id (default: the format's, `_make_id`)."""
        self._new_id = new_id or self._make_id
        self._text = ""
        self._pos = 0
        self._final = False
        self._out: list[Delta] = []
        self._segment = _Segment()
        self._region: _Region | None = None
        self._call: _Call | None = None
        self._next_index = 0
        self._skipping = False  # a failed region's text is being passed on as content

    # -- the interface --------------------------------------------------------------------

    def feed(self, text: str) -> list[Delta]:
        """The deltas that `text`, the output's next piece, settles."""
        return self._consume(text, final=False)

    def finish(self) -> list[Delta]:
        """The output has ended: the deltas of whatever was held."""
        return self._consume("", final=True)

    @classmethod
    def parse(cls, text: str, new_id: Callable[[], str] | None = None) -> Parsed:
        """The content and calls of a whole output."""
        return assemble(cls(new_id)._consume(text, final=True))

    def _consume(self, text: str, final: bool) -> list[Delta]:
        if self._final:
            raise RuntimeError(f"{type(self).__name__} was fed after the output ended")
        self._text += text
        self._final = final
        self._run()
        return self._commit()

    # -- what a format writes ---------------------------------------------------------------

    def _make_id(self) -> str:
        """A new call's id (a format whose template wants another kind overrides it)."""
        return new_call_id()

    @abstractmethod
    def _step(self) -> bool:
        """Advance from self._pos as far as one state allows; False when more text is
        needed (or, once final, none is left). Malformed fails the open region."""

    @abstractmethod
    def _close_at_end(self) -> None:
        """The output ended inside a region: end it (`_end_region`) if it may end here;
        a region left open (or Malformed) fails."""

    @abstractmethod
    def _resume(self) -> None:
        """A failed region's text has been passed on: read content again."""

    # -- the machine ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if self._skipping_step() if self._skipping else self._step():
                    continue
                if not self._final or self._region is None:
                    break
                self._close_at_end()
                if self._region is not None:
                    raise Malformed("cut short by the end of the output")
            except Malformed:
                self._fail_region()
        if self._final and self._segment.held and not self._segment.after_call:
            self._emit_content_now(self._segment.held)

    def _skipping_step(self) -> bool:
        end = self.region_end
        if end is None:
            self._emit_content(self._text[self._pos :])
            self._pos = len(self._text)
            return False
        if self._content_until((end,)) is None:
            return False
        self._emit_content(end)
        self._pos += len(end)
        self._skipping = False
        self._resume()
        return True

    def _commit(self) -> list[Delta]:
        out, self._out = self._out, []
        r = self._region
        if r is not None:
            r.committed = r.committed or self._next_index > r.first_index
            r.out_mark = 0
        if self._call is not None:
            self._call.start_at = None
        return out

    # -- reading text -----------------------------------------------------------------------

    def _look(self, marker: str) -> bool | None:
        """Whether the text at self._pos begins with `marker`; None when the text ends
        inside it (more may come; once final, the output ended there: `_close_at_end`)."""
        rest = self._text[self._pos : self._pos + len(marker)]
        if rest == marker:
            return True
        return None if marker.startswith(rest) else False

    def _skip_space(self, as_content: bool = False) -> bool:
        """Past whitespace (sent as content if `as_content`); whether a character follows."""
        text, i = self._text, self._pos
        while i < len(text) and text[i].isspace():
            i += 1
        if as_content:
            self._emit_content(text[self._pos : i])
        self._pos = i
        return i < len(text)

    def _content_until(self, markers: tuple[str, ...]) -> str | None:
        """Send the content up to the first of `markers` and stop there, returning it; or,
        when none is in the text yet, send what cannot begin one and return None."""
        text, pos = self._text, self._pos
        found: tuple[int, str] | None = None
        for m in markers:
            i = text.find(m, pos)
            if i >= 0 and (found is None or i < found[0]):
                found = (i, m)
        if found is not None:
            self._emit_content(text[pos : found[0]])
            self._pos = found[0]
            return found[1]
        end = len(text) if self._final else len(text) - _marker_tail(text, pos, markers)
        self._emit_content(text[pos:end])
        self._pos = end
        return None

    def _feed_json(self, reader: EnvelopeReader) -> bool:
        """The text to `reader` until it is done (True) or the text runs out (False)."""
        text = self._text
        while self._pos < len(text):
            reader.feed(text[self._pos])
            self._pos += 1
            if reader.done:
                return True
        return False

    def _feed_args(self, scanner: JsonScanner) -> bool:
        """The text to `scanner` as the current call's arguments, until they are complete
        (True) or the text runs out (False)."""
        text, start = self._text, self._pos
        try:
            while self._pos < len(text) and not scanner.done:
                scanner.feed(text[self._pos])
                self._pos += 1
        finally:
            if self._pos > start:
                self.call_args(text[start : self._pos])
        return scanner.done

    # -- content ------------------------------------------------------------------------------

    def _emit_content(self, text: str) -> None:
        seg = self._segment
        if not text:
            return
        if not seg.has_text:
            if text.isspace():
                seg.held += text
                return
            text, seg.held, seg.has_text = seg.held + text, "", True
        self._emit_content_now(text)

    def _emit_content_now(self, text: str) -> None:
        last = self._out[-1] if self._out else None
        if isinstance(last, ContentDelta):
            self._out[-1] = ContentDelta(last.text + text)
        else:
            self._out.append(ContentDelta(text))

    # -- regions ------------------------------------------------------------------------------

    def _begin_region(self) -> None:
        saved = dataclasses.replace(self._segment)
        self._region = _Region(self._pos, saved, self._next_index, len(self._out))

    def _end_region(self) -> None:
        r = self._region
        assert r is not None and self._call is None  # a format ends only a region it began
        if self._next_index == r.first_index:
            raise Malformed("no tool call in it")
        self._region = None
        self._segment = _Segment(after_call=True)

    def _fail_region(self) -> None:
        r = self._region
        assert r is not None  # Malformed is raised only while a region is read
        call, self._call, self._region = self._call, None, None
        if not r.committed:  # none of it has left: it never was a region
            del self._out[r.out_mark :]
            self._next_index = r.first_index
            self._segment = r.saved
            self._pos = r.start
        else:
            if call is not None and call.start_at is not None:
                del self._out[call.start_at :]
                self._next_index = call.index
            self._segment = _Segment(after_call=True)
        self._skipping = True

    # -- the sink verbs (envelope.py's CallSink) ------------------------------------------------

    def begin_call(self) -> None:
        self._call = _Call(self._next_index)

    def call_name(self, name: str) -> None:
        call = self._current()
        if call.name is not None:
            raise Malformed("a tool call with two names")
        if not 0 < len(name) <= MAX_NAME or not all(c.isprintable() for c in name):
            raise Malformed(f"{name[:MAX_NAME]!r} is not a function name")
        call.name = name
        self._start_when_ready(call)

    def call_args(self, text: str) -> None:
        call = self._current()
        call.args_begun = True
        if not call.started:
            call.pending_args.append(text)
            self._start_when_ready(call)
            return
        last = self._out[-1] if self._out else None
        if isinstance(last, ArgumentsDelta) and last.index == call.index:
            self._out[-1] = ArgumentsDelta(call.index, last.text + text)
        else:
            self._out.append(ArgumentsDelta(call.index, text))

    def end_call(self) -> None:
        call = self._current()
        if call.name is None:
            raise Malformed("a tool call without a name")
        if not call.args_begun:  # a call of a function without parameters
            call.args_begun = True
            call.pending_args.append("{}")
        self._start_when_ready(call)
        self._call = None

    def _current(self) -> _Call:
        assert self._call is not None  # readers call the verbs only inside a call
        return self._call

    def _start_when_ready(self, call: _Call) -> None:
        if call.started or call.name is None or not call.args_begun:
            return
        if not self._segment.has_text:
            self._segment.held = ""  # whitespace beside a call is not content
        call.started, call.start_at = True, len(self._out)
        self._out.append(CallStart(call.index, self._new_id(), call.name))
        self._next_index = call.index + 1
        if call.pending_args:
            self._out.append(ArgumentsDelta(call.index, "".join(call.pending_args)))
            call.pending_args.clear()


def _marker_tail(text: str, pos: int, markers: tuple[str, ...]) -> int:
    """How many characters at the end of text[pos:] could begin one of `markers`."""
    longest = min(max(len(m) for m in markers) - 1, len(text) - pos)
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0
