"""Token ids -> text deltas for one choice, with stop strings.

Stop strings are matched on text, across token boundaries. Text that could still be the
start of a stop string is held back until it cannot; on a match the text is cut before the
stop string and the choice ends with finish_reason "stop" (the caller aborts the engine
request, which is still generating).

A choice that ends inside a UTF-8 character (its last tokens hold only part of one) never
shows that part: the detokenizer holds it back as U+FFFD while it waits for the rest, and at
the end it is dropped, as vLLM drops it, rather than shown as U+FFFD. Its token ids and
logprobs are still reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"  # what the bytes of an unfinished UTF-8 character decode to


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class TextStream:
    def __init__(
        self, detok: Detokenizer, stop: Sequence[str] = (), include_stop: bool = False
    ) -> None:
        self.detok = detok
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self._held = ""  # decoded but not yet released (may begin a stop string)
        self.text = ""  # released so far
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Feed one generated token; returns the text released by it (maybe empty)."""
        if self.stopped:
            return ""
        return self._release(self._held + self.detok.push(token_id), final=False)

    def finish(self) -> str:
        """The stream ended (EOS, length, abort): release whatever was held, but for an
        unfinished character at the end."""
        if self.stopped:
            return ""
        tail = self.detok.flush().rstrip(REPLACEMENT_CHAR)
        return self._release(self._held + tail, final=True)

    def _release(self, pending: str, final: bool) -> str:
        cut = self._find_stop(pending)
        if cut is not None:
            self.stopped = True
            out = pending[:cut]
            self._held = ""
        elif final or not self.stop:
            out, self._held = pending, ""
        else:
            keep = self._partial_suffix(pending)
            out, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += out
        return out

    def _find_stop(self, pending: str) -> int | None:
        # Search from where a stop string could newly start (it may span released text too,
        # but released text never ends with a stop prefix, so pending alone suffices).
        best: int | None = None
        for s in self.stop:
            i = pending.find(s)
            if i >= 0:
                end = i + len(s) if self.include_stop else i
                best = end if best is None else min(best, end)
        return best

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
