"""How far a prefill worker's clock is from ours, from the timestamps of a Ping and its Pong.

`write_deadline` is wall-clock (docs/architecture.md §Clocks): across hosts the clocks must
agree within FENCE_MARGIN_S, or a fenced page could be reused while a late write lands. D
pings every P each second; each Pong echoes the Ping's unix time and carries P's. With the
round trip `rtt`, P stamped its Pong about `rtt / 2` after our Ping left, so

    skew = pong.sent_at - (ping.sent_at + rtt / 2)

to within rtt / 2. A skew past `clock_skew_warn_s` (half the margin) is logged as a warning, at
most once per peer per `clock_skew_warn_every_s` (runtime/timing.py `PdTiming`), and
/debug/state shows the last estimate. Sans-I/O: the caller passes the clocks' readings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.runtime.timing import PdTiming

log = logging.getLogger(__name__)


def estimate_skew(
    ping_sent_at: float, pong_sent_at: float, received_at: float, max_rtt_s: float
) -> float | None:
    """The peer's clock minus ours, in seconds; None if the timestamps cannot tell (a round
    trip slower than `max_rtt_s` says too little)."""
    rtt = received_at - ping_sent_at
    if ping_sent_at <= 0 or pong_sent_at <= 0 or not 0 <= rtt <= max_rtt_s:
        return None
    return pong_sent_at - (ping_sent_at + rtt / 2)


@dataclass
class SkewWatch:
    """One peer's last skew estimate, and when we last warned about it."""

    peer: str
    skew_s: float | None = None
    warned_at: float = float("-inf")  # monotonic

    def observe(
        self,
        ping_sent_at: float,
        pong_sent_at: float,
        received_at: float,
        now: float,
        timing: PdTiming,
    ) -> None:
        """A Pong's stamps, received at `received_at` (our unix time) and `now` (monotonic)."""
        skew = estimate_skew(ping_sent_at, pong_sent_at, received_at, timing.max_rtt_s)
        if skew is None:
            return
        self.skew_s = skew
        late = now - self.warned_at > timing.clock_skew_warn_every_s
        if abs(skew) > timing.clock_skew_warn_s and late:
            self.warned_at = now
            log.warning(
                "prefill worker %s: its clock is %+.2fs from ours; write deadlines are "
                "wall-clock and the fence allows %.1fs (docs/reliability.md §Clocks): "
                "synchronise the hosts' clocks (NTP, chrony)",
                self.peer,
                skew,
                timing.fence_margin_s,
            )
