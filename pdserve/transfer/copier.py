"""The data-plane worker: a prefill worker's page copies (shm, tcp) run off the engine thread.

The engine posts a copy and goes on to compute the next chunk; the copy runs on this
supervised thread (torch's copies release the GIL, so the two overlap) and the engine polls
the returned transfer like a NIXL one. A copy that has not started when it is cancelled never
runs; one that is running finishes (a bounded memcpy), which is why a cancelled transfer
counts as "bytes may have landed" and makes D fence the pages.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from pdserve.runtime.timing import COPIER_QUEUE_WAIT_S
from pdserve.transfer.errors import WriteError
from pdserve.transfer.frame_workers import FrameWorkers


@dataclass
class CopyTransfer:
    """One posted copy; `poll()` is True once it ran, and raises WriteError if it failed."""

    future: Future[None]
    nbytes: int
    deadline: float  # monotonic

    def poll(self) -> bool:
        if self.future.cancelled():
            return True
        if self.future.done():
            e = self.future.exception()
            if e is not None:
                raise WriteError(f"page copy failed: {type(e).__name__}: {e}") from e
            return True
        if time.monotonic() > self.deadline:
            self.future.cancel()
            raise WriteError("page copy did not run before its deadline; cancelled")
        return False

    def cancel(self) -> None:
        self.future.cancel()


class Copier:
    def __init__(self, workers: FrameWorkers | None = None) -> None:
        """`workers`: threads that share a copy's per-page work (the tcp backend's digests)."""
        self.workers = workers
        self.jobs: queue.Queue[tuple[Future[None], Callable[[], None]]] = queue.Queue()
        self.copied = 0  # jobs run, for /debug/state

    def submit(self, nbytes: int, copy: Callable[[], None], deadline: float) -> CopyTransfer:
        fut: Future[None] = Future()
        self.jobs.put((fut, copy))
        return CopyTransfer(fut, nbytes, deadline)

    def tick(self) -> None:
        """Run queued copies; the supervisor calls it forever (on the `dataplane` thread)."""
        try:
            fut, copy = self.jobs.get(timeout=COPIER_QUEUE_WAIT_S)
        except queue.Empty:
            return
        if not fut.set_running_or_notify_cancel():
            return  # cancelled before it started: nothing was written
        try:
            copy()
        except Exception as e:  # noqa: BLE001 - the copy's failure belongs to its room
            fut.set_exception(e)
        else:
            fut.set_result(None)
        self.copied += 1
