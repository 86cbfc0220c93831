"""How far a prefill worker's clock is from ours, from the timestamps of a Ping and its Pong.

`write_deadline` is wall-clock (docs/architecture.md §Clocks): across hosts the clocks must
agree within FENCE_MARGIN_S, or a fenced page could be reused while a late write lands. D
pings every P each second; each Pong echoes the Ping's unix time and carries P's. With the
round trip `rtt`, P stamped its Pong about `rtt / 2` after our Ping left, so

    skew = pong.sent_at - (ping.sent_at + rtt / 2)

to within rtt / 2. A skew past CLOCK_SKEW_WARN_S (half the margin) is logged as a warning, at
most once per peer per CLOCK_SKEW_WARN_EVERY_S, and /debug/state shows the last estimate.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pdserve.runtime.timing import (
    CLOCK_SKEW_WARN_EVERY_S,
    CLOCK_SKEW_WARN_S,
    FENCE_MARGIN_S,
    MAX_RTT_S,
)

log = logging.getLogger(__name__)


def estimate_skew(ping_sent_at: float, pong_sent_at: float, received_at: float) -> float | None:
    """The peer's clock minus ours, in seconds; None if the timestamps cannot tell."""
    rtt = received_at - ping_sent_at
    if ping_sent_at <= 0 or pong_sent_at <= 0 or not 0 <= rtt <= MAX_RTT_S:
        return None
    return pong_sent_at - (ping_sent_at + rtt / 2)


@dataclass
class SkewWatch:
    """One peer's last skew estimate, and when we last warned about it."""

    peer: str
    skew_s: float | None = None
    warned_at: float = float("-inf")  # monotonic

    def observe(self, ping_sent_at: float, pong_sent_at: float) -> None:
        skew = estimate_skew(ping_sent_at, pong_sent_at, time.time())
        if skew is None:
            return
        self.skew_s = skew
        now = time.monotonic()
        if abs(skew) > CLOCK_SKEW_WARN_S and now - self.warned_at > CLOCK_SKEW_WARN_EVERY_S:
            self.warned_at = now
            log.warning(
                "prefill worker %s: its clock is %+.2fs from ours; write deadlines are "
                "wall-clock and the fence allows %.1fs (docs/reliability.md §Clocks): "
                "synchronise the hosts' clocks (NTP, chrony)",
                self.peer,
                skew,
                FENCE_MARGIN_S,
            )
