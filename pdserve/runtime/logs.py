"""Logging for every pdserve process: one format, and no line repeated without bound.

A flood (a client retrying a bad request in a loop, a peer sending garbage, the accept loop at
the descriptor limit) must not turn into a log flood: one such loop once wrote 230 MB of log in
under a minute. `RepeatFilter` lets at most `burst` records with the same logger and message
template through per `window_s`; past that it counts them, and the first record of the next
window says how many were dropped.
"""

from __future__ import annotations

import logging
import os
import time

from pdserve.runtime.timing import LOG_REPEAT_WINDOW_S

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# A tag for every line of this process, set by a parent whose children share its log (the
# processes of one router, router/pool.py): "router-2" reads "... INFO [router-2] name: ...".
TAG_ENV = "PDSERVE_LOG_TAG"
BURST = 20
MAX_KEYS = 4096  # distinct (logger, template) pairs remembered; oldest window forgotten first


class RepeatFilter(logging.Filter):
    def __init__(self, burst: int = BURST, window_s: float = LOG_REPEAT_WINDOW_S) -> None:
        super().__init__()
        self.burst, self.window_s = burst, window_s
        # (logger, template) -> [window start, records this window, dropped this window]
        self._seen: dict[tuple[str, str], list[float]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        slot = self._seen.get(key)
        if slot is None or now - slot[0] > self.window_s:
            dropped = int(slot[2]) if slot is not None else 0
            if len(self._seen) >= MAX_KEYS:
                self._seen.clear()
            self._seen[key] = [now, 1, 0]
            if dropped:
                record.msg = f"{record.msg} [{dropped} more like this were not logged]"
            return True
        slot[1] += 1
        if slot[1] <= self.burst:
            return True
        slot[2] += 1
        return False


def setup(level: str) -> None:
    """The root logger at `level` (a name: DEBUG, INFO, ...), its handler rate-limited."""
    tag = os.environ.get(TAG_ENV)
    fmt = FORMAT.replace("%(name)s", f"[{tag}] %(name)s") if tag else FORMAT
    logging.basicConfig(level=level.upper(), format=fmt)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RepeatFilter())
