"""The worker's event loop takes its turns while the engine thread waits: one GIL, two threads.

A worker runs the engine thread and an asyncio loop (HTTP, output channels) in one interpreter.
The engine thread is the critical path: a served token's gap is its tick. Every torch call it
makes releases the GIL for a few microseconds, and a loop with I/O ready takes the GIL then and
keeps it until it blocks in a syscall (a socket write) or the switch interval (5 ms) hands it
back: its turn (a drain, an encode, a write: ~0.3 ms a tick at concurrency 128 on the H200)
lands inside the engine's tick, with the thread switches around it. Measured there
(benchmarks/RESULTS.md, 2026-12-05 c): the engine alone ticked at the step (ITL p50 1.76 ms
against a 1.77 ms step), served 2.36 ms, with its thread holding the GIL 53% of the time, the
loop 12%, and polling the GPU in 3% of its samples.

The gate is meant to schedule the loop into the engine's waits. The engine thread claims it
(`claim`, at its first tick) and opens it while it waits: for the GPU in
`runtime/gpu_wait.wait_event`, or idle, for its inbox. The loop's selector (`GatedSelector`),
woken from idle by I/O, waits for the gate to be open before the loop runs its callbacks, at
most `max_wait_s`, so the loop is never starved (a host-bound engine that never waits still
lets it in after that long). A turn that outlasts the engine's wait shares the GIL as before:
the gate only decides when a turn starts. Other threads (control, dataplane) are not gated.

The price: a step's outputs, pushed to the loop just after the engine's wait for them, reach
the loop at the engine's next wait (about a tick's host share later: ~1 ms at concurrency 128
on the H200), so each request's first token and its end come that much later; the gaps
between its tokens do not change.

Off unless PDSERVE_LOOP_GATE=1, and only for an engine on a GPU (on a CPU the engine never
waits for a device, so the loop would only ever get in at its bound), on asyncio's loop
(uvloop has no selector to gate) and Python 3.11+ (asyncio.Runner). Its effect on the served
ITL is not measured yet (no GPU was lent after it was written): runs of
`benchmarks/gpu_serving.py --loop-gate 1` and `--loop-gate 0`, alternated, will tell, TTFT
and end-to-end latency included, with each row's `gate_turns` (from the counts on /metrics:
how many of the loop's turns started in an engine wait, how many at the bound).
"""

from __future__ import annotations

import asyncio
import os
import selectors
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

# How long a loop with I/O ready waits for the engine to yield, at most: about one decode
# step, so a reply or a write is late by a step at worst while the engine is host-bound.
DEFAULT_MAX_WAIT_S = 0.002
ENV = "PDSERVE_LOOP_GATE"


def requested(event_loop: str) -> bool:
    """Whether PDSERVE_LOOP_GATE asks for the gate, for a worker whose loop is `event_loop`
    ("asyncio" or "uvloop", runtime/evloop.py). ValueError for a value other than 0 or 1 (a
    typo must not pass for off), or for a gate asked for where it cannot work: on uvloop, or
    before Python 3.11."""
    value = os.environ.get(ENV, "0").strip() or "0"
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: expected 0 or 1")
    if value == "0":
        return False
    if event_loop != "asyncio":
        raise ValueError(f"{ENV}=1 gates asyncio's loop, and this worker runs {event_loop}")
    if not hasattr(asyncio, "Runner"):
        raise ValueError(f"{ENV}=1 needs Python 3.11 or later (asyncio.Runner)")
    return True


class LoopGate:
    """Open while the engine thread waits; the event loop starts its turns while it is."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()  # nothing is running yet
        self.owner: int | None = None  # the engine thread, once it ticks
        self._released = False
        # The loop's turns that waited for the gate (written by the loop's thread only): those
        # that found it open or saw it open, those that started at their bound, and the
        # seconds they waited. On /metrics (`register`): whether the gate does what it is for.
        self.turns_open = 0
        self.turns_bound = 0
        self.waited_s = 0.0

    def claim(self) -> None:
        """The calling thread is the engine's: only its waits open the gate; it is busy now
        (not after `release`)."""
        if self._released:
            return
        self.owner = threading.get_ident()
        self._open.clear()

    def release(self) -> None:
        """The engine thread stopped (or is stopping): the gate stays open for good."""
        self._released = True
        self.owner = None
        self._open.set()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a wait of the engine thread (no-op on any other thread, or once released).
        Not nested: an inner wait's end would close the gate during the outer one."""
        if threading.get_ident() != self.owner:
            yield
            return
        self._open.set()
        try:
            yield
        finally:
            if self.owner is not None:  # released meanwhile: it stays open
                self._open.clear()

    def wait_turn(self, max_wait_s: float) -> bool:
        """Until the engine waits, or `max_wait_s`: whether it was open (counted)."""
        if self._open.is_set():
            self.turns_open += 1
            return True
        start = time.monotonic()
        opened = self._open.wait(max_wait_s)
        self.waited_s += time.monotonic() - start
        if opened:
            self.turns_open += 1
        else:
            self.turns_bound += 1
        return opened

    def register(self, registry: CollectorRegistry) -> None:
        """Its counts on `registry` (a worker's /metrics)."""
        registry.register(self)

    def describe(self) -> list[CounterMetricFamily]:
        return self.collect()

    def collect(self) -> list[CounterMetricFamily]:
        turns = CounterMetricFamily(
            "pdserve_loop_gate_turns",
            "Event-loop turns that waited for the loop gate, by how they started",
            labels=["start"],
        )
        turns.add_metric(["engine_waiting"], self.turns_open)
        turns.add_metric(["bound"], self.turns_bound)
        waited = CounterMetricFamily(
            "pdserve_loop_gate_wait_seconds", "Seconds the event loop waited for the loop gate"
        )
        waited.add_metric([], self.waited_s)
        return [turns, waited]


class GatedSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The loop's selector: with I/O ready, the loop's turn starts when the gate is open."""

    def __init__(self, gate: LoopGate, max_wait_s: float = DEFAULT_MAX_WAIT_S) -> None:
        super().__init__()
        self.gate = gate
        self.max_wait_s = max_wait_s

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        """A loop with no callbacks queued (a select that may block: waiting for I/O or a
        timer) that finds I/O ready waits for its turn; one with callbacks queued (timeout 0)
        goes on, so a turn's chain (a drain, the puts it makes, the writes they wake) is not
        split."""
        ready = super().select(timeout)
        if ready and (timeout is None or timeout > 0):
            self.gate.wait_turn(self.max_wait_s)
        return ready  # type: ignore[no-any-return]
