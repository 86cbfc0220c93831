"""A KV pool's layout as it travels between peers (D's Register, P's RegisterAck, /info).

The decoder checks the types; `KVLayout.from_desc` (kvcache/layout.py) checks the ranges
and derives the regions, raising only ValueError. Sans-I/O and torch-free.
"""

from __future__ import annotations

import msgspec


class BufferDesc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One KV buffer on the wire (kvcache/buffer_spec.py's BufferSpec checks the ranges)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layers: tuple[int, ...] | None = None
    tokens_per_row: int = 1


class StateDesc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One per-request state component on the wire (kvcache/v4_layout.py's StateSpec)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layers: tuple[int, ...]


class LayoutDesc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A KV pool's layout on the wire: `KVLayout.to_desc()` writes it, `KVLayout.from_desc()`
    checks a peer's (kvcache/layout.py). The types are checked by the decoder, the ranges
    there."""

    buffers: tuple[BufferDesc, ...]
    page_size: int
    num_layers: int
    tp_rank: int = 0
    tp_size: int = 1
    state: tuple[StateDesc, ...] = ()
