"""D estimates a prefill worker's clock skew from its pings and warns past half the fence margin."""

from __future__ import annotations

import logging

import pytest

from pdserve.protocol.sampling import SamplingParams
from pdserve.runtime.timing import (
    CLOCK_SKEW_WARN_EVERY_S,
    CLOCK_SKEW_WARN_S,
    MAX_RTT_S,
    PD_TIMING,
)
from pdserve.worker.decode.clock_skew import SkewWatch, estimate_skew
from tests.worker.wire import P_ADDR, Wire, ended

PROMPT = list(range(3, 40))


def test_the_estimate_takes_half_the_round_trip():
    # Our ping left at 100.0 and the pong came back at 100.2; P stamped it 103.1 on its clock.
    assert estimate_skew(100.0, 103.1, 100.2, MAX_RTT_S) == pytest.approx(3.0)
    assert estimate_skew(100.0, 99.1, 100.2, MAX_RTT_S) == pytest.approx(-1.0)


@pytest.mark.parametrize(
    "ping, pong, now",
    [
        (0.0, 5.0, 1.0),
        (100.0, 0.0, 100.1),
        (100.0, 101.0, 99.0),
        (100.0, 101.0, 100 + MAX_RTT_S + 1),
    ],
)
def test_timestamps_that_cannot_tell_give_no_estimate(ping, pong, now):
    assert estimate_skew(ping, pong, now, MAX_RTT_S) is None


def test_a_warning_once_per_peer_past_half_the_margin(caplog):
    watch = SkewWatch("tcp://p:1")
    wall, now = 1_700_000_000.0, 1000.0  # our clocks when the pongs arrive

    def pong(skew: float, at: float) -> None:  # a ping sent 0.2 s before, stamped by P
        watch.observe(wall - 0.2, wall - 0.1 + skew, wall, at, PD_TIMING)

    with caplog.at_level(logging.WARNING, "pdserve.worker.decode.clock_skew"):
        pong(CLOCK_SKEW_WARN_S / 2, now)  # within: no warning
        assert not caplog.records and watch.skew_s == pytest.approx(CLOCK_SKEW_WARN_S / 2)
        pong(3 * CLOCK_SKEW_WARN_S, now)
        pong(3 * CLOCK_SKEW_WARN_S, now + CLOCK_SKEW_WARN_EVERY_S)  # rate-limited
        assert len(caplog.records) == 1 and "tcp://p:1" in caplog.records[0].getMessage()
        pong(3 * CLOCK_SKEW_WARN_S, now + CLOCK_SKEW_WARN_EVERY_S + 0.1)  # once a period
    assert len(caplog.records) == 2 and watch.skew_s == pytest.approx(3 * CLOCK_SKEW_WARN_S)


def test_a_prefill_worker_whose_clock_is_ahead_is_reported(tiny_dir, caplog):
    wire = Wire(tiny_dir, p_wall_ahead_s=5.0)  # P's wall clock runs 5 s ahead of D's
    with caplog.at_level(logging.WARNING, "pdserve.worker.decode.clock_skew"):
        outs = wire.submit("r", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
        wire.run_until(lambda: ended(outs))
    assert outs[-1].finish_reason == "length"  # skew within the deadlines' slack: still served
    skew = wire.d_role.peers.get(P_ADDR).clock.skew_s
    assert skew == pytest.approx(5.0)  # the clock stands still: the round trip took no time
    snapshot = wire.d_role.snapshot(wire.clock.now)
    assert snapshot["peers"][0]["clock_skew_s"] == pytest.approx(5.0)
    assert any("its clock is +" in r.getMessage() for r in caplog.records), caplog.text
