"""runtime/gpu_wait.py: a wait for the GPU returns once the event is reached and gives up past
its bound (a fake event: the same protocol as torch.cuda.Event's query)."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.runtime.gpu_wait import GpuWaitTimeout, wait_event, waited_s


class After:
    """Reached after `n` queries (never, for n < 0)."""

    def __init__(self, n: int) -> None:
        self.n, self.queries = n, 0

    def query(self) -> bool:
        self.queries += 1
        return 0 <= self.n < self.queries


def test_returns_once_the_event_is_reached() -> None:
    e = After(5)
    wait_event(e, "a step")
    assert e.queries == 6


def test_a_hung_device_ends_the_wait_with_a_timeout() -> None:
    e = After(-1)
    with pytest.raises(GpuWaitTimeout, match="a step"):
        wait_event(e, "a step", timeout_s=0.05)
    assert e.queries > 1


class Until:
    """Reached once `seconds` have passed since it was made."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def query(self) -> bool:
        return time.monotonic() >= self.at


def test_the_time_a_thread_polled_is_counted_for_that_thread_only() -> None:
    before = waited_s()
    wait_event(After(0), "a step done already")
    assert waited_s() == before  # no poll: nothing counted
    wait_event(Until(0.05), "a step")
    assert 0.05 <= waited_s() - before < 5.0
    with pytest.raises(GpuWaitTimeout):
        wait_event(After(-1), "a hung step", timeout_s=0.02)
    assert waited_s() - before >= 0.07  # a wait that timed out counts too
    other: list[float] = []
    t = threading.Thread(target=lambda: other.append(waited_s()))
    t.start()
    t.join(timeout=5)
    assert other == [0.0]


def test_meanwhile_runs_between_polls_at_most_every_bound_and_is_not_counted_as_waited() -> None:
    from pdserve.runtime.gpu_wait import MEANWHILE_EVERY_S

    calls: list[float] = []

    def meanwhile() -> None:
        calls.append(time.monotonic())
        time.sleep(0.002)  # host work: not time spent waiting for the device

    before = waited_s()
    start = time.monotonic()
    wait_event(Until(0.1), "a step", meanwhile=meanwhile)
    took = time.monotonic() - start
    assert len(calls) >= 5  # it ran during the wait, again and again
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert min(gaps) >= 0.002 + MEANWHILE_EVERY_S  # its own time, then the bound, between calls
    assert waited_s() - before <= took - 0.002 * len(calls) + 1e-3
    calls.clear()
    wait_event(After(0), "a step done already", meanwhile=meanwhile)
    assert calls == []  # no wait, no work


def test_a_wait_that_times_out_still_ends_with_meanwhile_running() -> None:
    calls: list[int] = []
    with pytest.raises(GpuWaitTimeout):
        wait_event(After(-1), "a hung step", timeout_s=0.02, meanwhile=lambda: calls.append(1))
    assert calls
