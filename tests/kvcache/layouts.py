"""Layouts the KV tests share: the Llama family per dtype, and a DeepSeek-V3.2-like one.

"dsa" has three buffers of different widths and dtypes, and layers that lack some of them:
a bf16 MLA latent [1, 576] in every layer, and the indexer's fp8 keys [1, 128] with a float32
scale [1] per token beside them, in layers 0 and 2 only.
"""

from __future__ import annotations

import torch

from pdserve.kvcache.layout import BufferSpec, KVLayout
from pdserve.kvcache.pool import KVPool

NAMES = ("float32", "bfloat16", "float16", "dsa")  # every layout a transfer must carry


def dsa(page_size: int = 4, num_layers: int = 3) -> KVLayout:
    indexed = tuple(range(0, num_layers, 2))
    return KVLayout(
        (
            BufferSpec("latent", (1, 576), "bfloat16"),
            BufferSpec("index_k", (1, 128), "float8_e4m3fn", indexed),
            BufferSpec("index_k_scale", (1,), "float32", indexed),
        ),
        page_size=page_size,
        num_layers=num_layers,
    )


def layout(name: str) -> KVLayout:
    """A small layout by name: "dsa", or a dtype name for the Llama family."""
    if name == "dsa":
        return dsa()
    return KVLayout.llama(name, page_size=4, num_layers=3, num_kv_heads=2, head_dim=8)


def fill_random(pool: KVPool, seed: int) -> None:
    """Random bytes in every page: every bit pattern, fp8 and bf16 NaNs included."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, tuple(pool.data.shape), dtype=torch.uint8, generator=g)
    pool.data.copy_(noise)
