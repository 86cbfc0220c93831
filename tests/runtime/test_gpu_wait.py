"""runtime/gpu_wait.py: a wait for the GPU returns once the event is reached and gives up past
its bound (a fake event: the same protocol as torch.cuda.Event's query)."""

from __future__ import annotations

import pytest

from pdserve.runtime.gpu_wait import GpuWaitTimeout, wait_event


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
