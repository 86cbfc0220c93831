"""A simulated device for serving benchmarks on a CPU: the model's forward replaced by the batch
build and fixed logits (benchmarks/engine/stub_forward.py), and each launched step "runs" for a
fixed time on a device that does one step at a time, while the host goes on.

Named as what it is: a simulation, not a GPU. It reproduces the one thing a GPU step does to
the host that a CPU forward does not: the engine thread is free (it waits in
`gpu_wait.wait_event`, GIL released) for the step's length, and anything else in its process
(the worker's event loop) competes with its host work for the GIL only. With it, served
inter-token gaps against the simulated step show on a CPU what the serving path adds to the
engine's tick (the loop on one GIL with the engine, or the engine in a process of its own).

    install(step_ms, host_us)   patch pdserve's engine in this process (before any is built)

`host_us` adds that much host work per chunk of a step (a Python spin that releases the GIL
every GIL_SLICE_S, as the engine's torch calls do), to give the engine the host share of a
tick it has on a GPU host (1.25 of 1.89 ms at batch 128 on the H200) at a token rate a
2-core VM's router and client can carry.

gpu_serving.py `--sim-step-ms MS` puts benchmarks/serving/simdevice on its workers' PYTHONPATH
with PDSERVE_BENCH_SIM_STEP_MS set: that directory's sitecustomize.py calls `install` in every
process that imports pdserve's engine (a worker, or its engine process).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

SIM_ENV = "PDSERVE_BENCH_SIM_STEP_MS"
HOST_ENV = "PDSERVE_BENCH_SIM_HOST_US"
# The engine's host work on a GPU is mostly torch calls, each of which releases the GIL: a
# thread waiting for it (the worker's loop) gets in there, inside the tick. The spin releases
# it this often.
GIL_SLICE_S = 20e-6


class SimEvent:
    """A step's end on the simulated device: reached `done_at` (time.monotonic)."""

    def __init__(self, done_at: float) -> None:
        self.done_at = done_at

    def query(self) -> bool:
        return time.monotonic() >= self.done_at


class SimDevice:
    """One stream: a step launched at t starts at max(t, the previous step's end)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self._free_at = 0.0
        self._lock = threading.Lock()

    def launch(self) -> SimEvent:
        with self._lock:
            self._free_at = max(time.monotonic(), self._free_at) + self.step_s
            return SimEvent(self._free_at)


def install(step_ms: float, host_us: float = 0.0) -> None:
    """Every engine built from now on in this process runs on a SimDevice of `step_ms`, with
    `host_us` of extra host work per chunk of a step."""
    from benchmarks.engine.stub_forward import stub_forward
    from pdserve.engine import engine as engine_module
    from pdserve.engine import inflight
    from pdserve.runtime.gpu_wait import wait_event

    device = SimDevice(step_ms / 1e3)
    init = engine_module.Engine.__init__

    def engine_init(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        stub_forward(self)
        if host_us > 0:
            forward = self.runner.forward

            def forward_and_spin(chunks, feed=None):  # type: ignore[no-untyped-def]
                end = time.perf_counter() + len(chunks) * host_us / 1e6
                while (now := time.perf_counter()) < end:
                    piece = min(end, now + GIL_SLICE_S)
                    while time.perf_counter() < piece:
                        pass
                    time.sleep(0)  # as a torch call does: the GIL released, and taken back
                return forward(chunks, feed)

            self.runner.forward = forward_and_spin

    def launched(self: inflight.InFlight, device_: object) -> None:
        self._done = device.launch()  # type: ignore[assignment]

    picks = inflight.InFlight.picks

    def picks_after_the_step(
        self: inflight.InFlight, meanwhile: Callable[[], None] | None = None
    ) -> inflight.Picks:
        if self._done is not None:  # the sampled ids' copy lands when the step ends
            wait_event(self._done, "a simulated step", meanwhile=meanwhile)
        return picks(self)

    engine_module.Engine.__init__ = engine_init  # type: ignore[method-assign]
    inflight.InFlight.launched = launched  # type: ignore[method-assign]
    inflight.InFlight.picks = picks_after_the_step  # type: ignore[method-assign]
