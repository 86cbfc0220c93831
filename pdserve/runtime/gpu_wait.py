"""A bounded wait for GPU work: CUDA events have no timed wait, so a hung kernel would block a
thread in `Event.synchronize()` forever, with /health the only witness. `wait_event` polls the
event instead and raises past GPU_WAIT_TIMEOUT_S (runtime/timing.py), which ends the step or
the transfer that waited like any other failure of it.

A wait may do work `meanwhile`: the engine thread, waiting for a step's sampled ids, collects a
prefill role's finished writes so that their rooms' PrefillDone leaves during the next step
rather than after it (engine/role.py `Role.while_waiting`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from pdserve.runtime.timing import GPU_WAIT_TIMEOUT_S

# How often a wait calls its `meanwhile`, at most: often enough that what it answers is not held
# for a step, rarely enough that it does not take the GIL from the threads that serve.
MEANWHILE_EVERY_S = 0.0005


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


def wait_event(
    event: Event,
    what: str,
    timeout_s: float = GPU_WAIT_TIMEOUT_S,
    meanwhile: Callable[[], None] | None = None,
) -> None:
    """Until `event` completed (at once if it has). Between polls the thread yields the GIL,
    as `synchronize()` spins without it: the same latency, and other threads run. `meanwhile`,
    if given, is called between polls every MEANWHILE_EVERY_S at most; its time is the host's,
    not counted as waited. It must not block: the bound is checked between its calls."""
    if event.query():
        return
    start = time.monotonic()
    deadline = start + timeout_s
    busy = 0.0  # in `meanwhile`
    next_call = start + MEANWHILE_EVERY_S
    try:
        while not event.query():
            now = time.monotonic()
            if now > deadline:
                raise GpuWaitTimeout(f"{what}: the GPU did not get there in {timeout_s:.0f}s")
            if meanwhile is not None and now >= next_call:
                meanwhile()
                done = time.monotonic()
                busy += done - now
                next_call = done + MEANWHILE_EVERY_S
            time.sleep(0)
    finally:
        _clock.waited = waited_s() + time.monotonic() - start - busy
