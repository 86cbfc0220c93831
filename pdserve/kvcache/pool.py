"""The paged KV pool: the tensors, their layout descriptor, and the page allocator.

The pool is one contiguous tensor [num_layers, num_buffers, num_pages, page_size, kv_heads,
head_dim] so that a transfer backend can register or map it as one region; per-layer views
are handed to the model. The layout descriptor is derived from that tensor.
"""

from __future__ import annotations

import torch

from pdserve.kvcache.allocator import PageAllocator
from pdserve.kvcache.layout import KVLayout


def pages_for_budget(layout: KVLayout, budget_bytes: int) -> int:
    return budget_bytes // layout.bytes_per_page_all_layers


class KVPool:
    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device) -> None:
        if num_pages < 1:
            raise ValueError(
                f"KV budget fits no page: one page needs {layout.bytes_per_page_all_layers} bytes"
            )
        self.layout = layout
        self.num_pages = num_pages
        self.device = device
        self.data = torch.zeros(
            layout.num_layers,
            len(layout.buffers),
            num_pages,
            layout.page_size,
            layout.num_kv_heads,
            layout.head_dim,
            dtype=layout.torch_dtype,
            device=device,
        )
        self.allocator = PageAllocator(num_pages)

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.layout.page_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) views of layer i, each [num_pages, page_size, kv_heads, head_dim]."""
        return self.data[i, 0], self.data[i, 1]

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.layout.page_size)
