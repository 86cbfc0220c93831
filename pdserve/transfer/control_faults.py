"""The control plane's message faults, one rule for both directions (runtime/faults.py).

At a fault point `control.recv.<Type>` or `control.send.<Type>` a message may pass, be dropped,
be doubled, be held back and go out after the next message in the same direction (at most
HOLD_S later: `release_older`), or be replaced by an unknown-type or malformed frame, which
goes through the same decoder (recv) or onto the wire (send). `FaultedPath` applies that rule
to one direction; the control I/O thread owns one per direction and is its only caller.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import msgspec

from pdserve.runtime.faults import FAULTS, Verdict

T = TypeVar("T")

# What `unknown` and `malformed` faults put in a message's place.
UNKNOWN_FRAME = msgspec.msgpack.encode({"type": "FaultInjectedUnknown", "room": 0})
MALFORMED_FRAME = b"\xc1 fault-injected garbage"  # 0xc1 is never valid msgpack


class FaultedPath(Generic[T]):
    """One direction's messages through its fault points: `through(point, item)` hands `item`
    to `take` (or not, twice, later) and a replacement frame to `junk`."""

    def __init__(self, take: Callable[[T], None], junk: Callable[[T, bytes], None]) -> None:
        self.take, self.junk = take, junk
        self.held: deque[tuple[float, T]] = deque()  # held by `reorder`, oldest first

    def through(self, point: str, item: T) -> None:
        match FAULTS.hit(point):
            case Verdict.PASS:
                self.take(item)
            case Verdict.DROP:
                pass
            case Verdict.DUPLICATE:
                self.take(item)
                self.take(item)
            case Verdict.REORDER:
                self.held.append((time.monotonic(), item))
                return
            case Verdict.UNKNOWN:
                self.junk(item, UNKNOWN_FRAME)
            case Verdict.MALFORMED:
                self.junk(item, MALFORMED_FRAME)
        while self.held:  # what a reorder held goes out after this message
            self.take(self.held.popleft()[1])

    def release_older(self, than: float) -> None:
        """Hand on what was held since before `than` (monotonic)."""
        while self.held and self.held[0][0] < than:
            self.take(self.held.popleft()[1])
