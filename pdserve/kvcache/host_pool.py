"""The host-memory tier of the prefix cache: pages evicted from the device, kept in host memory.

A second paged pool with the device pool's own layout descriptor (the same `KVLayout` object,
so the two cannot differ): uint8 `[num_pages, page_bytes]`, pinned on CUDA so that copies are
asynchronous. Pages move as whole byte runs through a copier (kvcache/host_copier.py), never
by dtype. Entries are indexed by the same chain key as the device cache (prefix_cache.py), and
each keeps its parent key and token ids, so a hash collision is a miss here too.

References (a PageAllocator of its own, like the device pool's): the index holds one on each
page it lists, a load reading a page holds one more (`pin` / `unpin`) until its copy ended, and
so does the write filling it (`Write`), so LRU eviction, which takes only pages the index alone
holds, never reuses a page a copy still reads or writes.

Writes are kept until seen to end (`settle`, at each store and lookup pass): an entry is
indexed when its write is issued but served only once that write is DONE; a FAILED write's
entries are dropped, so a load never copies bytes that never arrived (on CUDA, loads and writes
share one stream, so a load would be ordered after the write anyway, but not saved from its
failure). On CUDA the host memory is unregistered and freed only after every copy this pool
issued has ended: a DMA still writing into freed memory would corrupt the heap.

Invariants (`violations`, in /debug/invariants): free + used = total; the used pages are
exactly the indexed ones, each under one key; every page's count is 1 + its pins + 1 while a
write fills it. Sans-I/O apart from the copies; engine-thread only.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from pdserve.kvcache.allocator import PageAllocator
from pdserve.kvcache.host_copier import Copy, CopyState, HostCopier, StreamCopier, SyncCopier
from pdserve.kvcache.pool import KVPool
from pdserve.runtime.gpu_wait import GpuWaitTimeout, wait_event
from pdserve.runtime.timing import GPU_WAIT_TIMEOUT_S

log = logging.getLogger(__name__)

# Host memory a copy may still write when its pool went away: never unregistered nor freed.
_KEPT_ALIVE: list[torch.Tensor] = []


class HostEntry(NamedTuple):
    page: int  # in the host pool
    parent: int  # the chain key of the page before it
    tokens: tuple[int, ...]


class Evicted(NamedTuple):
    """A device page on its way out of the device cache: where it is and what it holds."""

    key: int
    page: int  # in the device pool
    parent: int
    tokens: tuple[int, ...]


class Stored(NamedTuple):
    written: int  # pages copied to the host (or on their way)
    dropped: int  # host pages evicted (LRU) to make room


class Write(NamedTuple):
    """Pages on their way to the host: indexed, each held once more, not served until DONE."""

    copy: Copy
    keys: list[int]
    pages: list[int]  # in the host pool


class _Ended:
    """Whether every copy of a list has ended, as an event `wait_event` can poll."""

    def __init__(self, copies: list[Copy]) -> None:
        self.copies = copies

    def query(self) -> bool:
        return all(c.state() is not CopyState.PENDING for c in self.copies)


def pin(owner: object, data: torch.Tensor, in_flight: list[Copy]) -> None:
    """Page-lock `data` for asynchronous copies, exactly its size, until `owner` is collected
    and the copies in `in_flight` (a list the owner keeps current, in place) have ended.
    Not `pin_memory=True`: torch's host allocator rounds a block up to a power of two (a
    40 GiB tier would pin 64). Unpinned memory still copies correctly, only synchronously."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(data.data_ptr(), data.numel() * data.element_size(), 0)
    if int(err) != 0:
        log.warning("could not pin the host KV cache (cudaHostRegister: %s)", err)
        return
    weakref.finalize(owner, unpin_after, cudart, data, in_flight)


def unpin_after(
    cudart: Any, data: torch.Tensor, in_flight: list[Copy], timeout_s: float = GPU_WAIT_TIMEOUT_S
) -> bool:
    """Unregister `data` once every copy in `in_flight` has ended (a bounded wait); past the
    bound, or if the device cannot say, keep it registered and allocated for good rather
    than free memory a copy may still write. True if unregistered."""
    try:
        wait_event(_Ended(in_flight), "the host KV cache's last copies", timeout_s)
    except (GpuWaitTimeout, RuntimeError) as e:
        log.error("host KV cache: %s; its %d bytes stay allocated", e, data.numel())
        _KEPT_ALIVE.append(data)
        return False
    cudart.cudaHostUnregister(data.data_ptr())
    return True


def host_tier(device: KVPool, budget_bytes: int) -> HostPool | None:
    """The host pool for `--host-cache-mb` (as bytes) beside `device`; None when it is 0."""
    if budget_bytes <= 0:
        return None
    host = HostPool(device, budget_bytes // device.layout.page_bytes)
    log.info(
        "host KV cache: %d pages x %d tokens (%.1f MiB%s)",
        host.num_pages,
        host.layout.page_size,
        host.nbytes / 2**20,
        ", pinned" if host.data.is_pinned() else "",
    )
    return host


class HostPool:
    def __init__(self, device: KVPool, num_pages: int, copier: HostCopier | None = None) -> None:
        if num_pages < 1:
            raise ValueError(
                f"the host cache fits no page: one page needs {device.layout.page_bytes} bytes"
            )
        self.device = device
        self.layout = device.layout  # the descriptor the device pool was allocated from
        self.num_pages = num_pages
        on_cuda = device.data.device.type == "cuda"
        self.data = torch.zeros((num_pages, self.layout.page_bytes), dtype=torch.uint8)
        # Every copy issued and not yet seen to end (writes and loads): the memory outlives them.
        self.in_flight: list[Copy] = []
        if on_cuda:
            pin(self, self.data, self.in_flight)
        if tuple(device.data.shape[1:]) != tuple(self.data.shape[1:]):
            raise ValueError(
                f"device pages of {device.data.shape[1]} bytes, host pages of "
                f"{self.data.shape[1]}: not one layout"
            )
        if copier is None:
            copier = StreamCopier(device.data.device) if on_cuda else SyncCopier()
        self.copier = copier
        self.allocator = PageAllocator(num_pages)
        self._entries: OrderedDict[int, HostEntry] = OrderedDict()  # by key, least recent first
        self.pins: Counter[int] = Counter()  # page -> loads reading it
        self.writes: list[Write] = []  # issued, not yet seen to end
        self.writing: set[int] = set()  # their pages: neither served nor evicted
        self.write_failed_pages = 0  # entries dropped because their write failed

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def lookup(self, key: int, parent: int, tokens: tuple[int, ...]) -> HostEntry | None:
        """The entry under `key` if it holds these tokens and its bytes have arrived (call
        `settle` first to see writes that ended)."""
        got = self._entries.get(key)
        if got is None or got.parent != parent or got.tokens != tokens:
            return None  # absent, or a hash collision
        if got.page in self.writing:
            return None  # not written yet: its write may still fail
        return got

    def touch(self, keys: Sequence[int]) -> None:
        """Most recently used, the first page of a prefix last: eviction takes tails first."""
        for key in reversed(keys):
            self._entries.move_to_end(key)

    def store(self, pages: Sequence[Evicted]) -> Stored:
        """Copy device pages leaving the device cache into the host pool (asynchronous on
        CUDA: see host_copier), evicting least recently used host pages that no load reads.
        A key already here is only touched; a page with no room is not kept."""
        self.settle()  # pages whose writes ended may be evicted again
        pairs: list[tuple[int, int]] = []
        keys: list[int] = []
        dropped = 0
        for ev in pages:
            got = self._entries.get(ev.key)
            if got is not None:
                if got.parent == ev.parent and got.tokens == ev.tokens:
                    self._entries.move_to_end(ev.key)
                continue  # the same page, or a collision: the resident entry stays
            if self.allocator.num_free == 0:
                if not self._evict_one():
                    break  # every host page is being read by a load
                dropped += 1
            (host,) = self.allocator.allocate(1)
            self._entries[ev.key] = HostEntry(host, ev.parent, ev.tokens)
            pairs.append((ev.page, host))
            keys.append(ev.key)
        if not pairs:
            return Stored(0, dropped)
        try:
            copy = self.copier.copy(self.device.data, self.data, pairs, to_host=True)
        except Exception as e:  # noqa: BLE001 - a failed write costs the host copies only
            log.warning("writing %d pages to the host cache failed: %s", len(pairs), e)
            self.forget(keys)
            return Stored(0, dropped)
        written = [host for _, host in pairs]
        self.allocator.retain(written)  # the write's own reference, until it ended
        self.writes.append(Write(copy, keys, written))
        self.writing.update(written)
        self.in_flight.append(copy)
        failed = copy.state() is CopyState.FAILED
        self.settle()  # a synchronous copy has ended already
        return Stored(0 if failed else len(pairs), dropped)

    def settle(self) -> int:
        """Retire the writes that ended, in any order: a DONE write's pages are served from now
        on, a FAILED write's entries are dropped (their bytes never arrived). Returns how many
        entries were dropped."""
        self.in_flight[:] = [c for c in self.in_flight if c.state() is CopyState.PENDING]
        pending: list[Write] = []
        failed = 0
        for w in self.writes:
            state = w.copy.state()
            if state is CopyState.PENDING:
                pending.append(w)
                continue
            self.writing.difference_update(w.pages)
            self.allocator.release(w.pages)
            if state is CopyState.FAILED:
                log.warning("writing %d pages to the host cache failed", len(w.pages))
                failed += self.forget(w.keys)  # no load pinned them: they were never served
        self.writes = pending
        self.write_failed_pages += failed
        return failed

    def _evict_one(self) -> bool:
        for key, entry in self._entries.items():
            if self.allocator.refcount(entry.page) == 1:
                del self._entries[key]
                self.allocator.release([entry.page])
                return True
        return False

    def pin(self, pages: Sequence[int]) -> None:
        """A load will read `pages` (indexed ones): they stay until `unpin`."""
        self.allocator.retain(pages)
        self.pins.update(pages)

    def unpin(self, pages: Sequence[int]) -> None:
        for p in pages:
            if self.pins[p] < 1:
                raise ValueError(f"host page {p} unpinned but no load reads it")
        self.pins.subtract(pages)
        self.pins = +self.pins  # drop zero counts
        self.allocator.release(pages)

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> Copy:
        """Copy pinned host pages into device pages (which the caller's lease holds)."""
        pairs = list(zip(host_pages, device_pages, strict=True))
        copy = self.copier.copy(self.data, self.device.data, pairs, to_host=False)
        self.in_flight.append(copy)
        return copy

    def forget(self, keys: Sequence[int]) -> int:
        """Drop entries whose bytes are suspect (a load of them failed) unless a load still
        reads them; returns how many went."""
        gone = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and self.allocator.refcount(entry.page) == 1:
                del self._entries[key]
                self.allocator.release([entry.page])
                gone += 1
        return gone

    def violations(self) -> list[str]:
        """Host pool accounting: free + used = total, used pages = indexed pages (each once),
        every page's count = 1 (the index) + the loads reading it + 1 while written."""
        out = [f"host {v}" for v in self.allocator.violations()]
        a = self.allocator
        if a.num_free + a.num_used != a.num_pages:
            out.append(f"host pages: free {a.num_free} + used {a.num_used} != {a.num_pages}")
        indexed = Counter(e.page for e in self._entries.values())
        twice = [p for p, n in indexed.items() if n > 1]
        if twice:
            out.append(f"host pages indexed under several keys: {twice[:8]}")
        used = {p for p in range(a.num_pages) if a.refcount(p) > 0}
        if used != set(indexed):
            free_indexed = sorted(set(indexed) - used)[:8]
            unindexed = sorted(used - set(indexed))[:8]
            out.append(f"host pages free but indexed {free_indexed}, unindexed {unindexed}")
        writing = {p for w in self.writes for p in w.pages}
        if writing != self.writing or not writing <= set(indexed):
            out.append(
                f"host pages being written {sorted(self.writing)[:8]}, "
                f"its writes' {sorted(writing)[:8]}"
            )
        for p in used & set(indexed):
            want = 1 + self.pins[p] + (p in self.writing)
            if a.refcount(p) != want:
                out.append(
                    f"host page {p}: refcount {a.refcount(p)}, 1 + {self.pins[p]} pins"
                    + (" + its write" if p in self.writing else "")
                )
        return out[:20]

    def snapshot(self) -> dict[str, int]:
        return {
            "pages_total": self.num_pages,
            "pages_used": self.allocator.num_used,
            "pages_pinned": len(self.pins),
            "pages_writing": len(self.writing),
            "write_failed_pages": self.write_failed_pages,
            "page_bytes": self.layout.page_bytes,
        }
