"""D estimates a prefill worker's clock skew from its pings and warns past half the fence margin."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from pdserve.protocol.sampling import SamplingParams
from pdserve.runtime.timing import CLOCK_SKEW_WARN_S
from pdserve.worker.decode.clock_skew import MAX_RTT_S, SkewWatch, estimate_skew
from pdserve.worker.prefill import role as prefill
from tests.worker.wire import P_ADDR, Wire, ended

PROMPT = list(range(3, 40))


def test_the_estimate_takes_half_the_round_trip():
    # Our ping left at 100.0 and the pong came back at 100.2; P stamped it 103.1 on its clock.
    assert estimate_skew(100.0, 103.1, 100.2) == pytest.approx(3.0)
    assert estimate_skew(100.0, 99.1, 100.2) == pytest.approx(-1.0)


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
    assert estimate_skew(ping, pong, now) is None


def test_a_warning_once_per_peer_past_half_the_margin(caplog):
    watch = SkewWatch("tcp://p:1")
    with caplog.at_level(logging.WARNING, "pdserve.worker.decode.clock_skew"):
        now = time.time()
        watch.observe(now, now + CLOCK_SKEW_WARN_S / 2)  # within: no warning
        assert not caplog.records and watch.skew_s == pytest.approx(CLOCK_SKEW_WARN_S / 2, abs=0.1)
        watch.observe(now, now + 3 * CLOCK_SKEW_WARN_S)
        watch.observe(now, now + 3 * CLOCK_SKEW_WARN_S)  # rate-limited
    assert len(caplog.records) == 1 and "tcp://p:1" in caplog.records[0].getMessage()


def test_a_prefill_worker_whose_clock_is_ahead_is_reported(tiny_dir, monkeypatch, caplog):
    wire = Wire(tiny_dir)
    ahead = SimpleNamespace(time=lambda: time.time() + 5.0, monotonic=time.monotonic)
    monkeypatch.setattr(prefill, "time", ahead)  # P's wall clock runs 5 s ahead
    with caplog.at_level(logging.WARNING, "pdserve.worker.decode.clock_skew"):
        outs = wire.submit("r", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
        wire.run_until(lambda: ended(outs))
    assert outs[-1].finish_reason == "length"  # skew within the deadlines' slack: still served
    skew = wire.d_role.peers.get(P_ADDR).clock.skew_s
    assert skew == pytest.approx(5.0, abs=0.5)
    assert wire.d_role.snapshot()["peers"][0]["clock_skew_s"] == pytest.approx(5.0, abs=0.5)
    assert any("its clock is +" in r.getMessage() for r in caplog.records), caplog.text
