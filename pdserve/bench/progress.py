"""A plain-text progress line on stderr: done / total, failures, elapsed; rate-limited.

On a terminal the line rewrites itself; into a file or pipe it appends a line at most once
per `every_s` so that logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(
        self, total: int, enabled: bool = True, every_s: float = 1.0, out: TextIO | None = None
    ) -> None:
        self.total, self.enabled, self.every_s = total, enabled, every_s
        self.out = out or sys.stderr
        self.tty = self.out.isatty()
        self.done = self.failed = 0
        self.started = time.monotonic()
        self._last = 0.0

    def advance(self, failed: bool) -> None:
        self.done += 1
        self.failed += failed
        now = time.monotonic()
        if self.done == self.total or now - self._last >= (0.1 if self.tty else self.every_s):
            self._last = now
            self._show(final=self.done == self.total)

    def _show(self, final: bool) -> None:
        if not self.enabled:
            return
        pct = 100.0 * self.done / max(self.total, 1)
        line = (
            f"bench: {self.done}/{self.total} ({pct:5.1f}%) failed {self.failed} "
            f"elapsed {time.monotonic() - self.started:6.1f}s"
        )
        if self.tty:
            self.out.write("\r" + line + ("\n" if final else ""))
        else:
            self.out.write(line + "\n")
        self.out.flush()
