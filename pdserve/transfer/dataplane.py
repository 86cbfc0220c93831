"""Data-plane backends: how a prefill worker's pages reach a decode worker's pool.

Both backends complete a write before `write()` returns, so a room never has a write in
flight between engine steps:
* `shm` — the decode pool lives in /dev/shm; P maps it and copies pages straight in.
* `tcp` — P copies the pages out into frames that follow a KVChunk message on the control
  socket; D's engine copies them into the pool if the room still holds those pages.
Page bytes are laid out per page as [layers, buffers, page_size, kv_heads, head_dim], the
same for both sides because the layouts were compared at registration.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPool, map_shared
from pdserve.protocol.messages import KVChunk
from pdserve.transfer.control import Control

BACKENDS = ("shm", "tcp")


class WriteError(RuntimeError):
    """A KV write failed (the peer's memory is gone, the send queue refused it)."""


class PeerWriter(Protocol):
    def write(
        self, room: int, epoch: int, src: KVPool, src_pages: Sequence[int], dst_pages: Sequence[int]
    ) -> int: ...  # returns bytes moved


class ShmWriter:
    def __init__(self, shm_path: str, layout: KVLayout, num_pages: int) -> None:
        self.num_pages = num_pages
        self.dst = map_shared(Path(shm_path), layout, num_pages)

    def write(
        self, room: int, epoch: int, src: KVPool, src_pages: Sequence[int], dst_pages: Sequence[int]
    ) -> int:
        s = torch.tensor(list(src_pages), dtype=torch.long)
        d = torch.tensor(list(dst_pages), dtype=torch.long)
        pages = src.data.index_select(2, s.to(src.data.device)).cpu()
        self.dst.index_copy_(2, d, pages)
        return pages.numel() * pages.element_size()


class TcpWriter:
    def __init__(self, control: Control, peer: str, sender: str) -> None:
        self.control, self.peer, self.sender = control, peer, sender

    def write(
        self, room: int, epoch: int, src: KVPool, src_pages: Sequence[int], dst_pages: Sequence[int]
    ) -> int:
        # Raw bytes via a uint8 view: numpy has no bfloat16.
        frames = tuple(
            src.data[:, :, p].contiguous().view(torch.uint8).cpu().numpy().tobytes()
            for p in src_pages
        )
        self.control.send(
            self.peer,
            KVChunk(room=room, epoch=epoch, sender=self.sender, dst_pages=list(dst_pages)),
            frames,
        )
        return sum(len(f) for f in frames)


def receive_chunk(pool: KVPool, dst_pages: Sequence[int], frames: Sequence[bytes]) -> int:
    """D side of tcp: copy page frames into the pool; raises ValueError on a size mismatch."""
    layout = pool.layout
    per_page = layout.bytes_per_page_all_layers
    if len(frames) != len(dst_pages) or any(len(f) != per_page for f in frames):
        raise ValueError(
            f"KVChunk: {len(frames)} frames for {len(dst_pages)} pages, "
            f"{per_page} bytes each expected"
        )
    shape = (
        layout.num_layers,
        len(layout.buffers),
        layout.page_size,
        layout.num_kv_heads,
        layout.head_dim,
    )
    for page, frame in zip(dst_pages, frames, strict=True):
        pool.data[:, :, page].copy_(
            torch.frombuffer(bytearray(frame), dtype=layout.torch_dtype).view(shape)
        )
    return per_page * len(frames)
