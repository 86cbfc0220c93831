"""The paged KV pool: the tensors, their layout descriptor, and the page allocator.

The pool is one contiguous tensor [num_pages, num_layers, num_buffers, page_size, kv_heads,
head_dim] so that a transfer backend can register or map it as one region, and so that one
page of every layer is one contiguous run of bytes: a transfer moves a page as a single
descriptor (NIXL, tcp frames) instead of one per layer and buffer. Per-layer views
[num_pages, page_size, kv_heads, head_dim] (strided across pages) are handed to the model.
The layout descriptor is derived from that tensor.
"""

from __future__ import annotations

import mmap
import os
import uuid
from pathlib import Path

import torch

from pdserve.kvcache.allocator import PageAllocator
from pdserve.kvcache.layout import KVLayout

SHM_DIR = Path("/dev/shm")


def pages_for_budget(layout: KVLayout, budget_bytes: int) -> int:
    return budget_bytes // layout.bytes_per_page_all_layers


def pool_shape(layout: KVLayout, num_pages: int) -> tuple[int, ...]:
    return (
        num_pages,
        layout.num_layers,
        len(layout.buffers),
        layout.page_size,
        layout.num_kv_heads,
        layout.head_dim,
    )


def create_shared(layout: KVLayout, num_pages: int) -> tuple[torch.Tensor, int]:
    """A zeroed pool in shared memory that no name on disk outlives.

    The file is unlinked as soon as it is mapped; peers open it through
    /proc/<our pid>/fd/<fd>, so the memory goes away with the last process that maps it,
    even when this one is SIGKILLed. Returns the tensor and the open fd.
    """
    nbytes = num_pages * layout.bytes_per_page_all_layers
    path = SHM_DIR / f"pdserve-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        buf = mmap.mmap(fd, nbytes)
    finally:
        path.unlink()
    return torch.frombuffer(buf, dtype=layout.torch_dtype).view(pool_shape(layout, num_pages)), fd


def map_shared(path: Path, layout: KVLayout, num_pages: int) -> torch.Tensor:
    """Attach a peer's shared pool by the path it advertised."""
    nbytes = num_pages * layout.bytes_per_page_all_layers
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != nbytes:
            raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, layout implies {nbytes}")
        buf = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return torch.frombuffer(buf, dtype=layout.torch_dtype).view(pool_shape(layout, num_pages))


class KVPool:
    def __init__(
        self, layout: KVLayout, num_pages: int, device: torch.device, shared: bool = False
    ) -> None:
        """`shared`: place the pool in /dev/shm so a prefill peer can write pages into it."""
        if num_pages < 1:
            raise ValueError(
                f"KV budget fits no page: one page needs {layout.bytes_per_page_all_layers} bytes"
            )
        self.layout = layout
        self.num_pages = num_pages
        self.device = device
        self.shm_path: Path | None = None  # where a peer opens the shared pool
        self._shm_fd: int | None = None
        if shared:
            if device.type != "cpu":
                raise ValueError("a shared-memory KV pool lives on the CPU; use another backend")
            self.data, self._shm_fd = create_shared(layout, num_pages)
            self.shm_path = Path(f"/proc/{os.getpid()}/fd/{self._shm_fd}")
        else:
            self.data = torch.zeros(
                pool_shape(layout, num_pages), dtype=layout.torch_dtype, device=device
            )
        self.allocator = PageAllocator(num_pages)

    def close(self) -> None:
        """Stop offering the shared pool to new peers (mappings stay valid until dropped)."""
        if self._shm_fd is not None:
            os.close(self._shm_fd)
            self._shm_fd = None
            self.shm_path = None

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.layout.page_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) views of layer i, each [num_pages, page_size, kv_heads, head_dim]."""
        return self.data[:, i, 0], self.data[:, i, 1]

    def page(self, p: int) -> torch.Tensor:
        """Every layer's and buffer's slice of page p: one contiguous run of bytes."""
        return self.data[p]

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.layout.page_size)
