"""Frame workers: per-frame byte work (SHA-256, copies) spread over a few supervised threads.

The tcp data plane hashes every KV byte it sends or takes (transfer/bulk.py) and copies each
page once on each side. One core hashes about 2 GB/s, less than the KV a busy 1P+1D pair moves,
and both hashlib and numpy's copies release the GIL for large buffers, so a chunk's frames are
done on several threads at once. `map(fn, n)` runs fn(0) .. fn(n - 1): the calling thread takes
items itself while the workers take the rest, so it never waits on a worker that has not
started an item (with no workers, or every worker dead, the caller does them all). It waits
for an item a worker holds at most FRAME_WORK_WAIT_S; an item's exception is raised in the
caller, who owns the chunk it belongs to.

`default_workers()` is the rule for how many: a quarter of the process's cores, at most
MAX_WORKERS (a worker host runs both the engine and its control and data-plane threads), none
on a machine of four cores or fewer, where the callers' own threads already fill them.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from pdserve.runtime.timing import COPIER_QUEUE_WAIT_S, FRAME_WORK_WAIT_S

T = TypeVar("T")
MAX_WORKERS = 3


def default_workers(cpus: int | None = None) -> int:
    """Worker threads for a process on `cpus` cores (default: those it may run on)."""
    n = len(os.sched_getaffinity(0)) if cpus is None else cpus
    return min(MAX_WORKERS, n // 4) if n > 4 else 0


class _Batch(Generic[T]):
    """One `map` call: items are claimed one at a time by whichever thread asks first."""

    def __init__(self, fn: Callable[[int], T], n: int) -> None:
        self.fn, self.n = fn, n
        self.results: list[T | None] = [None] * n
        self.error: BaseException | None = None
        self._next = 0
        self._left = n
        self._lock = threading.Lock()
        self.done = threading.Event()
        if n == 0:
            self.done.set()

    def work(self) -> None:
        """Run items until none is left unclaimed."""
        while True:
            with self._lock:
                i = self._next
                if i >= self.n or self.error is not None:
                    return
                self._next += 1
            try:
                self.results[i] = self.fn(i)
            except Exception as e:  # noqa: BLE001 - raised in the caller, which owns the chunk
                with self._lock:
                    self.error = self.error or e
                    self._left -= self.n - self._next  # nobody will run the rest
                    self._next = self.n
            with self._lock:
                self._left -= 1
                if self._left <= 0:
                    self.done.set()


class FrameWorkers:
    def __init__(self, workers: int) -> None:
        if workers < 0:
            raise ValueError(f"frame workers: {workers} threads")
        self.workers = workers
        self._batches: queue.Queue[_Batch[object]] = queue.Queue()

    def map(self, fn: Callable[[int], T], n: int) -> Sequence[T]:
        """[fn(0), ..., fn(n - 1)], run here and on the workers; raises the first item's
        exception, or TimeoutError if a worker held an item past FRAME_WORK_WAIT_S."""
        batch: _Batch[T] = _Batch(fn, n)
        for _ in range(min(self.workers, n - 1)):  # the caller takes one share itself
            self._batches.put(batch)  # type: ignore[arg-type]
        batch.work()
        if not batch.done.wait(FRAME_WORK_WAIT_S):
            raise TimeoutError(f"a frame worker held an item for over {FRAME_WORK_WAIT_S} s")
        if batch.error is not None:
            raise batch.error
        return batch.results  # type: ignore[return-value]

    def tick(self) -> None:
        """One worker's turn; the supervisor calls it forever on each `frames-N` thread."""
        try:
            batch = self._batches.get(timeout=COPIER_QUEUE_WAIT_S)
        except queue.Empty:
            return
        batch.work()
