"""D's stager (tcp backend): KV page frames checked and staged off the control and engine threads.

A KVChunk's bulk frames reach D's control thread unchecked (transfer/bulk.py). The `stager`
thread, with the frame workers (transfer/frame_workers.py), checks each frame against its
digest and copies it out of ZMQ's buffers into one host tensor (pinned for a GPU pool), and
hands the engine a `StagedChunk`. So the control thread only reads sockets and checks MACs,
and the engine thread only writes a staged chunk into the room's pages (to a GPU: one
asynchronous copy from pinned memory, then one per page).

Order: a room's PrefillDone follows its KVChunks on the socket, and D decodes only once every
byte it counts has landed (transfer/receiver.py: tcp's bytes never trail PrefillDone). So the
stager keeps the control thread's order for every message: one that comes while chunks are
queued goes behind them, through the stager; with none queued it goes straight to the engine.
A FirstToken always goes straight: it asks for no order (D streams the token only while the
room still waits for its PrefillDone), and it exists so the first token need not wait for KV.

Bounds (LESSONS #18): a chunk of more than MAX_CHUNK_BYTES (control_limits.py: P splits its
writes below it) is refused unread. At most STAGE_MAX_BYTES of KV is held between the control
thread and the engine: frames waiting here, and staged rows until the engine has written and
dropped them (each row tensor releases its bytes when it is freed). A chunk that comes when more
would be held is refused without a byte of it read and its frames let go: the engine gets it as
refused, and its room fails. So the control thread never blocks, and D's memory for KV in
transit stays bounded whatever a peer sends.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.protocol.messages import FirstToken, KVChunk
from pdserve.runtime.timing import COPIER_QUEUE_WAIT_S
from pdserve.transfer.bulk import Bulk
from pdserve.transfer.control import Inbound
from pdserve.transfer.control_limits import MAX_CHUNK_BYTES
from pdserve.transfer.frame_workers import FrameWorkers

# KV held between the control thread and the engine, at most: far above what is held while the
# stager and the engine keep up (a few chunks), far below a host's memory.
STAGE_MAX_BYTES = 1 << 30


@dataclass(frozen=True)
class StagedChunk:
    """A KVChunk for D's engine: its pages' bytes, each checked, in host memory; or why not."""

    peer: str
    msg: KVChunk
    rows: torch.Tensor | None  # [len(msg.dst_pages), page_bytes] uint8, pinned for a GPU pool
    refused: str = ""  # why the chunk was not staged (its room fails with it)


class Stager:
    def __init__(
        self,
        deliver: Callable[[object], None],
        page_bytes: int,
        pin: bool,
        workers: FrameWorkers | None = None,
    ) -> None:
        """`deliver`: hands a message or StagedChunk to the engine (its inbox); `page_bytes`:
        the size of every frame; `pin`: stage in pinned memory (a GPU pool)."""
        self.deliver = deliver
        self.page_bytes = page_bytes
        self.pin = pin
        self.workers = workers
        self._jobs: queue.Queue[tuple[Inbound, str]] = queue.Queue()
        # Order: the queue's state and every delivery. Reentrant: a staged row freed on this
        # thread while it delivers releases its bytes under it.
        self._lock = threading.RLock()
        self._waiting = 0  # messages put and not yet delivered
        self._bytes = 0  # KV held: queued frames, and staged rows not yet freed
        self.staged = 0  # chunks staged, for /debug/state
        self.refused = 0  # chunks refused (full, bad frames)

    def put(self, inbound: Inbound) -> None:
        """The control thread's: `inbound` to the engine, after every message before it."""
        chunk = isinstance(inbound.msg, KVChunk)
        size = inbound.bulk.nbytes if chunk and inbound.bulk is not None else 0
        with self._lock:
            if isinstance(inbound.msg, FirstToken) or (not chunk and not self._waiting):
                self.deliver(inbound)
                return
            why = ""
            if size > max(MAX_CHUNK_BYTES, self.page_bytes):
                why = f"a KV chunk of {size} bytes (at most {MAX_CHUNK_BYTES})"
            elif size and self._bytes + size > STAGE_MAX_BYTES:
                why = f"D already holds {self._bytes} bytes of KV in transit"
            if why:  # refused unread: its frames go now
                inbound, size = Inbound(inbound.peer, inbound.msg), 0
            self._waiting += 1
            self._bytes += size
            self._jobs.put((inbound, why))

    def tick(self) -> None:
        """Stage the next queued chunk and deliver it (the supervisor calls this forever, on
        the `stager` thread)."""
        try:
            inbound, why = self._jobs.get(timeout=COPIER_QUEUE_WAIT_S)
        except queue.Empty:
            return
        out: object = inbound
        size = inbound.bulk.nbytes if inbound.bulk is not None else 0
        try:
            if isinstance(inbound.msg, KVChunk):
                out = self._stage(inbound.peer, inbound.msg, inbound.bulk, why)
        finally:
            with self._lock:
                self._waiting -= 1
                self._bytes -= size  # the frames go; staged rows hold their own bytes
                self.deliver(out)

    def _stage(self, peer: str, msg: KVChunk, bulk: Bulk | None, why: str) -> StagedChunk:
        """The chunk's rows, every frame checked against its digest, or why not."""
        if not why:
            try:
                rows = self._rows(msg, bulk)
            except Exception as e:  # noqa: BLE001 - a bad chunk fails its room, not this thread
                why = f"{type(e).__name__}: {e}"
            else:
                self.staged += 1
                self._hold(rows)
                return StagedChunk(peer, msg, rows)
        self.refused += 1
        return StagedChunk(peer, msg, None, why)

    def _hold(self, rows: torch.Tensor) -> None:
        """Count `rows` as held until the tensor is freed (the engine wrote it, or dropped it)."""
        size = rows.numel()
        with self._lock:
            self._bytes += size
        weakref.finalize(rows, self._release, size)

    def _release(self, size: int) -> None:
        with self._lock:
            self._bytes -= size

    def snapshot(self) -> dict[str, int]:
        """For /debug/state: chunks staged and refused, KV bytes held, messages queued."""
        with self._lock:
            return {
                "staged": self.staged,
                "refused": self.refused,
                "held_bytes": self._bytes,
                "waiting": self._waiting,
            }

    def _rows(self, msg: KVChunk, bulk: Bulk | None) -> torch.Tensor:
        n = len(msg.dst_pages)
        sizes = bulk.sizes if bulk is not None else []
        if len(sizes) != n or any(s != self.page_bytes for s in sizes):
            raise ValueError(
                f"{len(sizes)} frames for {n} pages, {self.page_bytes} bytes each expected"
            )
        rows = torch.empty(n, self.page_bytes, dtype=torch.uint8, pin_memory=self.pin)
        if bulk is None:
            return rows
        out = rows.numpy()

        def one(i: int) -> None:  # hashlib and numpy's copy release the GIL
            np.copyto(out[i], np.frombuffer(bulk.checked(i), dtype=np.uint8))

        if self.workers is None:
            for i in range(n):
                one(i)
        else:
            self.workers.map(one, n)
        return rows
