"""The `nixl` data plane: P WRITEs pages into D's registered pool through NIXL (UCX).

NIXL moves bytes; it does not bound time. A WRITE to a peer that stopped (SIGSTOP) stays
"in progress" for ever, and only releasing the handle ends it. So pdserve adds what NIXL
lacks (LESSONS: every wait bounded, pages are leases):
* every transfer carries a deadline (the room's write deadline, capped); when it passes the
  handle is released and the room fails with `writes_cancelled`, which makes D fence the
  destination pages instead of freeing them;
* a peer that disconnects (NIXL's typed nixlRemoteDisconnectError) raises PeerGone, and the
  prefill role fails every room of that peer at once, not only the room whose write noticed;
* agent metadata and the pool descriptor travel inside pdserve's own Register message, so the
  pairing lives and dies with the control plane we already supervise;
* each WRITE carries a notification "pdkv1 ROOM EPOCH BYTES"; D counts the bytes that landed
  per room and decodes only when they equal what PrefillDone reports.

Only the engine thread of a worker touches its agent (NIXL's sync mode NONE is then safe).
The engine also drives UCX's progress as it polls (see PROGRESS_THREAD_ENV); on one host UCX
copies through CMA while the write is posted, over RDMA the NIC moves the bytes while the
engine computes the next chunk.

Descriptors: the pool is bytes [pages, page_bytes] (kvcache/pool.py), so one page of every
layer and buffer is one contiguous run of `layout.page_bytes` at `base + page * page_bytes`,
whatever the buffers' dtypes. Both sides prepare the list of their pages once; a write is one
transfer request that picks rows by index, and NIXL's make_prepped_xfer merges rows that are
consecutive on *both* sides into one descriptor (its trace log says so): exactly the spans
`page_spans` computes (`NixlTransfer.descriptors`). Each descriptor is one UCX operation (over
cuda_ipc, one copy), so a write of scattered pages runs well below one contiguous write
(benchmarks/RESULTS.md, 2026-12-01 and its second session; benchmarks/transfer/transfer.py separates
the pages' pattern from pdserve's own cost). So the allocators hand out the lowest free pages
in order (kvcache/allocator.py): a request's pages are one span on a quiet pool and a few
under churn, where freed pages queued at the back would scatter them. The Python around a
write (indices, make_prepped_xfer, release) is small beside the copy; a prepared request
cannot be reused, as each write names other pages and another notification.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPool
from pdserve.kvcache.rank_pages import RankPages
from pdserve.protocol.messages import NixlPool
from pdserve.runtime.timing import TRANSFER_TIMEOUT_S
from pdserve.transfer.dataplane import StepDone
from pdserve.transfer.errors import PeerGone, WriteError

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "pip install nixl-cu13 (CUDA 13) or nixl-cu12 (CUDA 12; `pip install 'pdserve[nixl]'`); "
    "either runs on CPU-only hosts too"
)
NOTIF_PREFIX = b"pdkv1"
# UCX's progress thread, as NIXL's Python API starts it, busy-polls a core for ever (its delay
# is hard-coded to 0). It steals that core from torch's compute threads and makes writes
# slower, not faster (benchmarks/RESULTS.md, 2026-11-29 later): on one host UCX copies
# through CMA inside the posting call anyway. So agents run without it and the
# engine drives UCX as it polls (every tick; every 0.5 ms while a transfer is open). Set
# PDSERVE_NIXL_PROGRESS_THREAD=1 where UCX moves data over TCP between hosts, so bytes keep
# moving through a long compute step.
PROGRESS_THREAD_ENV = "PDSERVE_NIXL_PROGRESS_THREAD"


class BackendUnavailable(RuntimeError):
    """The nixl backend was asked for but NIXL is not installed."""


# NIXL ships one wheel per CUDA major, each its own module; `nixl` is a source build. A UCX
# built for another CUDA cannot register VRAM: on a CUDA 13 host the cu12 wheel's UCX has no
# CUDA support, while nixl-cu13 moves VRAM to VRAM between two processes. So the wheel that
# matches torch's CUDA is tried first; on a CPU-only host any of them moves DRAM.
NIXL_MODULES = ("nixl_cu13", "nixl_cu12", "nixl._api")


def nixl_modules(torch_cuda: str | None) -> tuple[str, ...]:
    """Module names to try, the one built for `torch_cuda` ("13.0", "12.8", None) first."""
    major = (torch_cuda or "").split(".")[0]
    preferred = [m for m in NIXL_MODULES if major and m == f"nixl_cu{major}"]
    return tuple(preferred + [m for m in NIXL_MODULES if m not in preferred])


def import_nixl() -> ModuleType:
    # NIXL logs every agent and backend creation at INFO on stdout; keep its warnings only.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import torch

    for name in nixl_modules(torch.version.cuda):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise BackendUnavailable(f"--backend nixl needs NIXL: {INSTALL_HINT}")


def nixl_available() -> bool:
    try:
        import_nixl()
    except BackendUnavailable:
        return False
    return True


def write_error(what: str, e: Exception) -> WriteError:
    """NIXL's exception as ours: a remote disconnect is PeerGone, anything else WriteError."""
    # By name: the bindings module is nixl._bindings, nixl_cu12._bindings or nixl_cu13's.
    cls = PeerGone if type(e).__name__ == "nixlRemoteDisconnectError" else WriteError
    return cls(f"{what}: {type(e).__name__}: {e}")


def page_runs(layout: KVLayout, base: int, num_pages: int, device_id: int) -> np.ndarray:
    """Every page of a pool at `base` as one run: an Nx3 (address, length, device) array."""
    size = layout.page_bytes
    out = np.empty((num_pages, 3), dtype=np.uint64)
    out[:, 0] = base + np.arange(num_pages, dtype=np.uint64) * np.uint64(size)
    out[:, 1] = size
    out[:, 2] = device_id
    return out


def run_indices(pages: Sequence[int]) -> np.ndarray:
    """Rows of `page_runs` for `pages`, in order (row i is page i on both sides)."""
    return np.array(pages, dtype=np.int32)


class Span(NamedTuple):
    """`pages` pages from `src` on P to `dst` on D, consecutive on both: one descriptor."""

    src: int
    dst: int
    pages: int


def page_spans(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[Span]:
    """The descriptors a write of `src_pages[i] -> dst_pages[i]` becomes: neighbouring pairs
    merge while both sides go up by one page (NIXL's own merge rule for prepared rows)."""
    src, dst = run_indices(src_pages), run_indices(dst_pages)
    starts = span_starts(src, dst)
    ends = np.append(starts[1:], len(src)) if len(starts) else starts
    return [Span(int(src[i]), int(dst[i]), int(e - i)) for i, e in zip(starts, ends, strict=True)]


def span_starts(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Positions in `src`/`dst` (rows of `run_indices`) where a new descriptor starts."""
    if src.shape != dst.shape:
        raise ValueError(f"{len(src)} source pages for {len(dst)} destination pages")
    if len(src) == 0:
        return np.zeros(0, dtype=np.intp)
    breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
    return np.flatnonzero(np.concatenate(([True], breaks)))


def notif(room: int, epoch: int, nbytes: int) -> bytes:
    return b"%s %d %d %d" % (NOTIF_PREFIX, room, epoch, nbytes)


def parse_notif(msg: bytes) -> tuple[int, int, int] | None:
    """(room, epoch, bytes) from a notification, or None for one that is not ours."""
    parts = msg.split()
    if len(parts) != 4 or parts[0] != NOTIF_PREFIX:
        return None
    try:
        room, epoch, nbytes = (int(p) for p in parts[1:])
    except ValueError:
        return None
    return room, epoch, nbytes


class NixlAgent:
    """One worker's NIXL agent with its whole KV pool registered and its runs prepared."""

    def __init__(self, name: str, pool: KVPool, progress_thread: bool | None = None) -> None:
        self.nixl = import_nixl()
        self.name = name
        self.pool = pool
        if progress_thread is None:
            progress_thread = os.environ.get(PROGRESS_THREAD_ENV, "0") == "1"
        cfg = self.nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        self.agent = self.nixl.nixl_agent(name, cfg)
        self.mem = "VRAM" if pool.data.is_cuda else "DRAM"
        self.device_id = pool.data.device.index or 0
        try:
            self.reg = self.agent.register_memory(pool.data)
        except Exception as e:  # noqa: BLE001 - NIXL's errors are untyped here: explain
            raise BackendUnavailable(
                f"NIXL could not register the KV pool as {self.mem} ({type(e).__name__}: {e}); "
                + (
                    "this NIXL/UCX build has no CUDA support: use --backend tcp for GPU pools"
                    if self.mem == "VRAM"
                    else "check UCX_TLS (it must include tcp)"
                )
            ) from e
        self.local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            page_runs(pool.layout, pool.data.data_ptr(), pool.num_rows, self.device_id),
            self.mem,
        )
        self.unreleased: list[Any] = []  # handles NIXL refused to release yet; retried
        self.bad_notifs = 0

    def descriptor(self) -> NixlPool:
        return NixlPool(
            agent_md=self.agent.get_agent_metadata(),
            base=self.pool.data.data_ptr(),
            device_id=self.device_id,
            mem=self.mem,
        )

    def landed(self) -> list[tuple[int, int, int]]:
        """D side: (room, epoch, bytes) of every WRITE that completed since the last call."""
        out = []
        for msgs in self.agent.get_new_notifs().values():
            for msg in msgs:
                parsed = parse_notif(msg)
                if parsed is None:
                    self.bad_notifs += 1
                else:
                    out.append(parsed)
        return out

    def progress(self) -> None:
        """Drive UCX (it has no progress thread here); P gets no notifications, D uses landed()."""
        self.bad_notifs += sum(len(v) for v in self.agent.get_new_notifs().values())

    def settle(self, timeout_s: float = 1.0) -> None:
        """Before an agent or a remote agent is dropped: keep UCX progressing for a bounded
        time, so that requests queued for a peer that died fail and leave UCX's queues."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            self.progress()
            time.sleep(0.001)

    def release(self, handle: Any) -> bool:
        """Release a transfer handle; False (and kept for retry) if NIXL cannot cancel it yet."""
        try:
            handle.release()
            return True
        except Exception as e:  # noqa: BLE001 - any NIXL error: keep it and retry later
            log.warning("NIXL could not release a transfer handle yet: %s", e)
            self.unreleased.append(handle)
            return False

    def retry_releases(self) -> None:
        pending, self.unreleased = self.unreleased, []
        for h in pending:
            self.release(h)


@dataclass
class NixlTransfer:
    """One WRITE. Posted once its pages are computed (`ready`, on a GPU), then polled: `poll()`
    is True once it completed; it raises WriteError on failure or past its deadline."""

    agent: NixlAgent
    handle: Any
    nbytes: int
    deadline: float  # monotonic
    rows: tuple[np.ndarray, np.ndarray]  # (src, dst) rows of page_runs, as posted
    ready: StepDone | None = None  # posted only after this event completed
    posted: bool = False
    done: bool = False

    @property
    def descriptors(self) -> int:
        """How many descriptors NIXL posts for this write (its page_spans); counted on
        demand, so a write does not pay for it."""
        return len(span_starts(*self.rows))

    def post_if_ready(self) -> None:
        """Post the WRITE if its pages are computed; raises WriteError if NIXL refuses it."""
        if self.posted or (self.ready is not None and not self.ready.query()):
            return
        try:
            state = self.agent.agent.transfer(self.handle)
        except Exception as e:  # noqa: BLE001 - typed NIXL errors become a failed write
            self._finish()
            raise write_error("NIXL could not post the write", e) from e
        self.posted = True
        if state == "ERR":
            self._finish()
            raise WriteError("NIXL refused to post the write (peer gone?)")

    def poll(self) -> bool:
        if self.done:
            return True
        self.post_if_ready()
        if not self.posted:
            if time.monotonic() > self.deadline:
                self._finish()
                raise WriteError("the step that computes its pages did not end before the deadline")
            return False
        try:
            state = self.agent.agent.check_xfer_state(self.handle)
        except Exception as e:  # noqa: BLE001 - typed NIXL errors (peer disconnect, ...)
            self._finish()
            raise write_error("NIXL transfer failed", e) from e
        if state == "DONE":
            self._finish()
            return True
        if state == "ERR":
            self._finish()
            raise WriteError("NIXL transfer reported an error (peer gone?)")
        if time.monotonic() > self.deadline:
            self._finish()
            raise WriteError("NIXL transfer did not complete before its deadline; cancelled")
        return False

    def cancel(self) -> None:
        if not self.done:
            self._finish()

    def _finish(self) -> None:
        self.done = True
        self.agent.release(self.handle)


class NixlWriter:
    """P's writer into one decode worker's pool."""

    def __init__(self, agent: NixlAgent, remote: NixlPool, layout: KVLayout, num_pages: int):
        self.agent = agent
        self.layout = layout
        self.num_pages = num_pages
        self.remote_name = agent.agent.add_remote_agent(remote.agent_md)
        try:
            self.remote = agent.agent.prep_xfer_dlist(
                self.remote_name,
                page_runs(layout, remote.base, num_pages, remote.device_id),
                remote.mem,
            )
        except Exception:
            agent.agent.remove_remote_agent(self.remote_name)
            raise

    def write(
        self,
        room: int,
        epoch: int,
        src: RankPages,  # (this writer reads the pool its agent registered)
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        deadline: float,
        ready: StepDone | None = None,
    ) -> NixlTransfer:
        nbytes = len(src_pages) * self.layout.page_bytes
        src_rows, dst_rows = run_indices(src_pages), run_indices(dst_pages)
        a = self.agent
        try:
            # One request for the whole write; NIXL merges the rows into page_spans.
            handle = a.agent.make_prepped_xfer(
                "WRITE", a.local, src_rows, self.remote, dst_rows, notif(room, epoch, nbytes)
            )
        except Exception as e:  # noqa: BLE001 - typed NIXL errors become a failed write
            raise write_error("NIXL could not prepare the write", e) from e
        limit = min(deadline, time.monotonic() + TRANSFER_TIMEOUT_S)
        xfer = NixlTransfer(a, handle, nbytes, limit, (src_rows, dst_rows), ready)
        xfer.post_if_ready()  # else the first poll that finds the step done posts it
        return xfer

    def close(self) -> None:
        try:
            self.remote.release()
            self.agent.agent.remove_remote_agent(self.remote_name)
        except Exception as e:  # noqa: BLE001 - the peer is being dropped anyway
            log.warning("NIXL: dropping remote agent %s: %s", self.remote_name, e)
