"""A bounded wait for GPU work: CUDA events have no timed wait, so a hung kernel would block a
thread in `Event.synchronize()` forever, with /health the only witness. `wait_event` polls the
event instead and raises past GPU_WAIT_TIMEOUT_S (runtime/timing.py), which ends the step or
the transfer that waited like any other failure of it.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from pdserve.runtime.timing import GPU_WAIT_TIMEOUT_S


class Event(Protocol):
    def query(self) -> bool: ...


# Per thread: .waited, seconds it spent polling in wait_event.
_clock = threading.local()


def waited_s() -> float:
    """Seconds the calling thread has spent in `wait_event` polling an event not yet reached,
    since it started: a tick's wall time minus this is the host's share of the tick
    (benchmarks/engine/engine_load.py), which tells a host-bound engine from a GPU-bound one."""
    return float(getattr(_clock, "waited", 0.0))


class GpuWaitTimeout(TimeoutError):
    """The GPU did not reach an event in time."""


def wait_event(event: Event, what: str, timeout_s: float = GPU_WAIT_TIMEOUT_S) -> None:
    """Until `event` completed (at once if it has). Between polls the thread yields the GIL,
    as `synchronize()` spins without it: the same latency, and other threads run."""
    if event.query():
        return
    start = time.monotonic()
    deadline = start + timeout_s
    try:
        while not event.query():
            if time.monotonic() > deadline:
                raise GpuWaitTimeout(f"{what}: the GPU did not get there in {timeout_s:.0f}s")
            time.sleep(0)
    finally:
        _clock.waited = waited_s() + time.monotonic() - start
