"""Data-plane backends: how a prefill worker's pages reach a decode worker's pool.

A writer's `write()` posts the pages and returns a `Pending` transfer that the prefill
engine polls; the room holds its source pages until every transfer of it completed or was
cancelled. `shm` and `tcp` copy on the data-plane worker thread (transfer/copier.py) when
one is given, else inside `write()`; `nixl` (transfer/nixl.py) completes in UCX's background
progress. Either way the engine computes the next chunk while the last one's pages move.
* `shm` — the decode pool lives in /dev/shm; P maps it and copies pages straight in.
* `tcp` — P copies the pages out (pinned host memory from a GPU) and sends them, with their
  digests, as bulk frames after a KVChunk message on the control socket (transfer/bulk.py);
  D's stager checks and stages them (transfer/stager.py) and D's engine writes them into the
  pool if the room still holds those pages.
* `nixl` — P WRITEs into D's NIXL-registered pool; notifications tell D what landed.
A page is one contiguous run of `layout.page_bytes` bytes (every layer's typed buffers,
kvcache/layout.py) of the whole model's layout, the same on both sides because the layouts were
compared at registration: at TP > 1 a side's pages are read and written through its ranks'
pools (kvcache/rank_pages.py), so either side's TP is its own. Backends move pages as raw
bytes and never look at the buffers' dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPool, ShmRef, map_shared
from pdserve.kvcache.rank_pages import RankPages, rank_layout
from pdserve.protocol.messages import KVChunk
from pdserve.runtime.gpu_wait import wait_event
from pdserve.transfer.bulk import Bulk
from pdserve.transfer.control import Control
from pdserve.transfer.control_limits import chunk_pages
from pdserve.transfer.errors import PeerGone as PeerGone
from pdserve.transfer.errors import WriteError as WriteError

if TYPE_CHECKING:
    from pdserve.transfer.copier import Copier


class StepDone(Protocol):
    """What a write waits on before it reads its pages: `torch.cuda.Event`, recorded on the
    engine's stream after the step that computed them (`step_done`). Without it a transfer that
    reads VRAM on its own (NIXL) could read KV the GPU has not written yet."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def step_done(pool: KVPool) -> StepDone | None:
    """An event marking the end of the work queued so far on the pool's device; None on CPU,
    where a forward has finished when it returns."""
    if not pool.data.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class Pending(Protocol):
    """One posted write of a room's pages."""

    nbytes: int

    def poll(self) -> bool:
        """True once complete; raises WriteError if it failed or its deadline passed."""
        ...

    def cancel(self) -> None:
        """Stop waiting for it and release it (its bytes may or may not have landed)."""
        ...


@dataclass
class Completed:
    """A write that finished inside `write()`."""

    nbytes: int

    def poll(self) -> bool:
        return True

    def cancel(self) -> None:
        pass


class PeerWriter(Protocol):
    def write(
        self,
        room: int,
        epoch: int,
        src: RankPages,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        deadline: float,  # monotonic: the write must be complete or cancelled by then
        ready: StepDone | None = None,
    ) -> Pending:
        """Post a write of `src_pages` into the peer's `dst_pages`. `ready`: on a GPU, an event
        recorded after the step that filled the pages; no byte is read before it completed."""
        ...

    def close(self) -> None: ...


def post(copier: Copier | None, nbytes: int, copy: Callable[[], None], deadline: float) -> Pending:
    """Run `copy` on the data-plane worker if there is one, else here and now."""
    if copier is not None:
        return copier.submit(nbytes, copy, deadline)
    copy()
    return Completed(nbytes)


class ShmWriter:
    def __init__(
        self,
        refs: Sequence[ShmRef],
        layout: KVLayout,
        num_pages: int,
        copier: Copier | None = None,
        dp: bool = False,
    ) -> None:
        """`refs`: the decode worker's pool per rank (one at TP 1), `layout` the whole model's;
        `dp`: its pages numbered over the pools in turn (data-parallel attention). Raises
        PoolRefused unless each names a pdserve pool of its rank's layout and `num_pages`
        pages."""
        self.num_pages = num_pages
        tp = len(refs)
        pools = [
            map_shared(ref, rank_layout(layout, tp, r), num_pages) for r, ref in enumerate(refs)
        ]
        self.dst = RankPages(layout, pools, dp=dp)
        self.copier = copier

    def write(
        self,
        room: int,
        epoch: int,
        src: RankPages,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        deadline: float,
        ready: StepDone | None = None,
    ) -> Pending:
        src_pages, dst_pages = list(src_pages), list(dst_pages)

        def copy() -> None:
            if ready is not None:  # on the copier thread: the engine computes on meanwhile
                wait_event(ready, "the step that computed the pages")
            self.dst.write(dst_pages, src.read(src_pages))

        nbytes = len(src_pages) * src.page_bytes
        return post(self.copier, nbytes, copy, deadline)

    def close(self) -> None:
        pass  # the mapping goes with the tensor


class TcpWriter:
    def __init__(
        self, control: Control, peer: str, sender: str, copier: Copier | None = None
    ) -> None:
        """`copier`: the data-plane thread that copies and hashes the pages (with its frame
        workers), else this thread, inside `write()`."""
        self.control, self.peer, self.sender = control, peer, sender
        self.copier = copier
        self.workers = copier.workers if copier is not None else None

    def write(
        self,
        room: int,
        epoch: int,
        src: RankPages,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        deadline: float,
        ready: StepDone | None = None,
    ) -> Pending:
        src_pages, dst_pages = list(src_pages), list(dst_pages)

        def copy() -> None:
            if ready is not None:
                wait_event(ready, "the step that computed the pages")
            # One bulk frame per page, a row of our own copy (ZMQ sends from it), in chunks of
            # at most chunk_pages. A send only queues the message on the control outbox, ahead
            # of the PrefillDone that follows.
            step = chunk_pages(src.page_bytes)
            for at in range(0, max(1, len(src_pages)), step):
                rows = src.copy_out(src_pages[at : at + step]).numpy()  # [n, page_bytes]
                bulk = Bulk.seal([memoryview(row) for row in rows], self.workers)
                pages = dst_pages[at : at + step]
                msg = KVChunk(room=room, epoch=epoch, sender=self.sender, dst_pages=pages)
                self.control.send(self.peer, msg, bulk)

        nbytes = len(src_pages) * src.page_bytes
        return post(self.copier, nbytes, copy, deadline)

    def close(self) -> None:
        pass
