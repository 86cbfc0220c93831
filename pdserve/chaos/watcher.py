"""A watcher: long requests of the harness's own straight to one worker, one after another,
so that one is in flight there whenever a fault comes (chaos/tp.py); each one's times (wall
clock) and how it ended are kept, to be held against the fault's time.

Every request is bounded (CALL_S, a socket read); `join` is bounded too.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from pdserve.runtime import httpcall

WATCH_TOKENS = 400  # each watcher request: long enough to be in flight at any moment
CALL_S = 60.0  # one watcher request's bound (a socket read)


@dataclass
class Ask:
    """One watcher request: when it went out and came back (wall clock), and how."""

    started: float
    ended: float
    ok: bool
    error: str


@dataclass
class Watcher:
    """Long requests straight to one worker, one after another, until one fails or `stop`."""

    url: str
    index: int
    stop: threading.Event
    asks: list[Ask] = field(default_factory=list)
    thread: threading.Thread | None = None

    def start(self) -> Watcher:
        self.thread = threading.Thread(target=self._run, name=f"watch-{self.index}", daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        body = {"prompt": f"watcher {self.index} says", "max_tokens": WATCH_TOKENS,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        while not self.stop.is_set():
            t0 = time.time()
            r = httpcall.post(self.url + "/v1/completions", body, CALL_S)
            why = "" if r.ok else (r.error or f"HTTP {r.status}: {str(r.body)[:400]}")
            self.asks.append(Ask(t0, time.time(), r.ok, why))
            if not r.ok:
                return

    def join(self, timeout_s: float) -> bool:
        """True once it ended; False if its request is still out after `timeout_s` (a hang)."""
        assert self.thread is not None
        self.thread.join(max(timeout_s, 0.0))
        return not self.thread.is_alive()
