"""Request ids a decode (or co-located) worker was told to abort, kept a while: an abort can
overtake its own /generate.

The router posts /generate on one connection and, when its client leaves, /abort on another;
a pooled connection can deliver the abort before a new one delivers the /generate (its
accept, under a storm, waits in the listen backlog). The abort of an id the engine does not
know is a no-op, so without this the /generate that came second would run with no client
until its outputs reached the router's channel, which aborts it again (LESSONS #17): a
queued request could hold pages for seconds. So every aborted id is remembered for
ABORTED_KEEP_S (runtime/timing.py: far longer than a connection's accept can lag), at most
MAX_ABORTED of them, and a /generate naming one is refused (409) before it reaches the
engine. Ids are unique per request: the router never sends an id again after aborting it.
Sans-I/O: the caller passes the time.
"""

from __future__ import annotations

from collections import OrderedDict

from pdserve.runtime.timing import ABORTED_KEEP_S

MAX_ABORTED = 65_536


class AbortedIds:
    def __init__(self, keep_s: float = ABORTED_KEEP_S, cap: int = MAX_ABORTED) -> None:
        self.keep_s, self.cap = keep_s, cap
        self._when: OrderedDict[str, float] = OrderedDict()  # id -> when aborted, oldest first
        self.refused = 0  # /generate calls refused for an id aborted before (for /debug)

    def add(self, request_id: str, now: float) -> None:
        self._when.pop(request_id, None)
        self._when[request_id] = now
        self._expire(now)
        while len(self._when) > self.cap:
            self._when.popitem(last=False)

    def refuse(self, request_id: str, now: float) -> bool:
        """True (and counted) if `request_id` was aborted within keep_s."""
        self._expire(now)
        if request_id in self._when:
            self.refused += 1
            return True
        return False

    def _expire(self, now: float) -> None:
        # Kept in insertion order, which is time order: the sweep stops at the first one
        # still fresh (LESSONS #13: the order is the structure's own, not assumed).
        while self._when:
            rid, when = next(iter(self._when.items()))
            if now - when <= self.keep_s:
                return
            del self._when[rid]

    def __len__(self) -> int:
        return len(self._when)
