"""The paged KV pool: its bytes, typed views of them, and the page allocator.

The pool is one byte tensor [num_pages, page_bytes] (uint8) so that a transfer backend can
register or map it as one region, and so that one page of every layer and buffer is one
contiguous run: a transfer moves a page as a single descriptor (NIXL, tcp frames) instead of
one per layer and buffer, and never needs to know the buffers' dtypes. The layout descriptor
(kvcache/layout.py) says where each (layer, buffer) lives in a page; `view` turns that region
of every page into a strided tensor of the buffer's dtype [num_pages, page_size, *shape] that
aliases the pool's bytes, which is what the model reads and writes.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.kvcache.allocator import PageAllocator
from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.state_pool import StatePool, pages_per_slot

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "pdserve-kv-"
_TOKEN = re.compile(r"[0-9a-f]{32}")


class PoolRefused(ValueError):
    """A peer named something that is not a pdserve KV pool it owns. The message says only
    that: nothing about what the named thing is, where it lives or how large it is."""


@dataclass(frozen=True)
class ShmRef:
    """How a peer on this host finds a shared pool: the owner's pid, the fd it keeps the pool
    open on, and the random token in the pool's (unlinked) name. Never a path: the opener
    builds /proc/PID/fd/FD itself and accepts what it opened only if it is a deleted
    /dev/shm/pdserve-kv-TOKEN file of the right size (`map_shared`)."""

    pid: int
    fd: int
    token: str


def pool_rows(layout: KVLayout, num_pages: int, state_slots: int) -> int:
    """Pages a pool of `num_pages` KV pages and `state_slots` state slots spans: what a peer
    maps or registers (the slots' pages follow the KV pages)."""
    each = pages_per_slot(layout.state, layout.page_bytes) if layout.state else 0
    return num_pages + state_slots * each


def pages_for_budget(layout: KVLayout, budget_bytes: int, state_slots: int = 0) -> int:
    """Pages that fit the budget once `state_slots` slots of the layout's per-request state
    (if it has any) are taken off."""
    each = pages_per_slot(layout.state, layout.page_bytes) if layout.state else 0
    state = each * layout.page_bytes * state_slots
    return max(0, budget_bytes - state) // layout.page_bytes


def _pages(buf: mmap.mmap, layout: KVLayout, num_pages: int) -> torch.Tensor:
    """A mapping as the pool's bytes [num_pages, page_bytes]."""
    return torch.frombuffer(buf, dtype=torch.uint8).view(num_pages, layout.page_bytes)


def create_shared(layout: KVLayout, num_pages: int) -> tuple[torch.Tensor, ShmRef]:
    """A zeroed pool in shared memory that no name on disk outlives.

    The file is unlinked as soon as it is mapped; peers open it through
    /proc/<our pid>/fd/<fd>, so the memory goes away with the last process that maps it,
    even when this one is SIGKILLed. Its name carries a random token that peers must
    present (ShmRef). Returns the bytes [num_pages, page_bytes] and the ShmRef.
    """
    nbytes = num_pages * layout.page_bytes
    st = os.statvfs(SHM_DIR)
    if st.f_bavail * st.f_frsize < nbytes:  # tmpfs pages are taken on first touch: a SIGBUS
        raise ValueError(
            f"{SHM_DIR} has {st.f_bavail * st.f_frsize / 2**20:.0f} MiB free, and a shared KV "
            f"pool of {nbytes / 2**20:.0f} MiB was asked for: give less KV budget or a larger "
            f"{SHM_DIR}"
        )
    token = secrets.token_hex(16)
    path = SHM_DIR / f"{SHM_PREFIX}{token}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        buf = mmap.mmap(fd, nbytes)
    finally:
        path.unlink()
    return _pages(buf, layout, num_pages), ShmRef(os.getpid(), fd, token)


def map_shared(ref: ShmRef, layout: KVLayout, num_pages: int) -> torch.Tensor:
    """Attach a peer's shared pool, as its bytes [num_pages, page_bytes]; PoolRefused unless
    `ref` names a pdserve pool of that size.

    What was opened is checked, not what was named (no race between a check and the open):
    a regular file with no name left, whose deleted name is /dev/shm/pdserve-kv-<token>."""
    if not (
        isinstance(ref.pid, int)
        and isinstance(ref.fd, int)
        and isinstance(ref.token, str)
        and 0 < ref.pid < 2**22
        and 0 <= ref.fd < 2**20
        and _TOKEN.fullmatch(ref.token)
    ):
        raise PoolRefused("the shm pool reference is malformed")
    refused = PoolRefused("the shm pool reference does not name a pdserve KV pool")
    link = f"/proc/{ref.pid}/fd/{ref.fd}"
    try:  # stat first: opening a device or a FIFO can block or have effects of its own
        if not stat.S_ISREG(os.stat(link).st_mode):
            raise refused
        fd = os.open(link, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        raise refused from None  # which errno it was would say what the path is
    try:
        st = os.fstat(fd)
        opened = os.readlink(f"/proc/self/fd/{fd}")
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_nlink != 0
            or opened != f"{SHM_DIR}/{SHM_PREFIX}{ref.token} (deleted)"
        ):
            raise refused
        nbytes = num_pages * layout.page_bytes
        if st.st_size != nbytes:
            raise PoolRefused("the shm pool's size does not match the layout and page count")
        buf = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return _pages(buf, layout, num_pages)


class KVPool:
    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        device: torch.device,
        shared: bool = False,
        state_slots: int = 0,
        dp_ranks: int = 1,
    ) -> None:
        """`shared`: place the pool in /dev/shm so a prefill peer can write pages into it.
        `state_slots`: per-request state slots, for a layout that has state (DeepSeek-V4).
        `dp_ranks`: data-parallel attention's ranks, each with a pool like this one; the
        allocator hands out all their pages, rank r's being part r (kvcache/allocator.py),
        and this pool is part 0."""
        if num_pages < 1:
            if layout.state:
                each = pages_per_slot(layout.state, layout.page_bytes) * layout.page_bytes
                raise ValueError(
                    f"KV budget fits no page beside {state_slots} per-request state slots of "
                    f"{each} bytes: give more KV budget or fewer --max-running"
                )
            raise ValueError(f"KV budget fits no page: one page needs {layout.page_bytes} bytes")
        self.layout = layout
        self.num_pages = num_pages  # KV pages, the allocator's; state slots' pages follow
        self.device = device
        self.shm: ShmRef | None = None  # how a peer on this host opens the shared pool
        if layout.state and state_slots < 1:
            raise ValueError("this KV layout keeps per-request state: give it state slots")
        each = pages_per_slot(layout.state, layout.page_bytes) if layout.state else 0
        rows = pool_rows(layout, num_pages, state_slots)
        if shared:
            if device.type != "cpu":
                raise ValueError("a shared-memory KV pool lives on the CPU; use another backend")
            self.data, self.shm = create_shared(layout, rows)  # [rows, page_bytes] uint8
        else:
            self.data = torch.zeros((rows, layout.page_bytes), dtype=torch.uint8, device=device)
        self.allocator = PageAllocator(num_pages * dp_ranks, parts=dp_ranks)
        self.state: StatePool | None = None  # per-request state (kvcache/state_pool.py)
        if layout.state:
            slots = self.data[num_pages:].view(state_slots, each * layout.page_bytes)
            self.state = StatePool(layout.state, slots, num_pages, each)

    def close(self) -> None:
        """Stop offering the shared pool to new peers (mappings stay valid until dropped)."""
        if self.shm is not None:
            os.close(self.shm.fd)
            self.shm = None

    @property
    def num_rows(self) -> int:
        """Pages of bytes the pool spans: its KV pages, then its state slots' pages."""
        return self.data.shape[0]

    @property
    def state_slots(self) -> int:
        return self.state.num_slots if self.state is not None else 0

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.layout.page_size

    def view(self, layer: int, name: str) -> torch.Tensor:
        """Buffer `name` of `layer` in every page: [num_pages, rows per page, *shape] of its dtype
        (rows per page: page_size, or page_size / tokens_per_row for a compressed buffer),
        strided across pages, aliasing the pool's bytes (writes through it land in the pool).
        KeyError if that layer has no such buffer."""
        r = self.layout.region(layer, name)
        raw = self.data[: self.num_pages, r.offset : r.offset + r.nbytes]  # [num_pages, nbytes]
        # Legal as a view: the region's offset and page_bytes are multiples of ALIGN, so
        # every page's slice starts aligned for the dtype and the page stride divides evenly.
        typed = raw.view(r.spec.torch_dtype)  # [num_pages, rows * prod(shape)]
        rows = r.spec.rows_per_page(self.layout.page_size)
        return typed.view(self.num_pages, rows, *r.spec.shape)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) views of layer i, each [num_pages, page_size, kv_heads, head_dim] (a Llama
        family layout: KVLayout.llama)."""
        return self.view(i, "k"), self.view(i, "v")

    def page(self, p: int) -> torch.Tensor:
        """Page p's bytes, every layer and buffer: uint8 [page_bytes], one contiguous run."""
        return self.data[p]

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.layout.page_size)
