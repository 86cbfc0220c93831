"""The KV layout descriptor: one description of a paged KV pool, derived from its real tensors.

Everything that touches KV bytes (the pool, a host tier, a transfer backend) computes offsets
from this descriptor, never from class constants. Two pools can exchange pages only if their
descriptors agree field by field; `mismatch` names the first field that differs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class KVLayout:
    """Shape of a paged pool: `num_pages` pages of `page_size` tokens for every layer and buffer.

    Each (layer, buffer) is a view [num_pages, page_size, num_kv_heads, head_dim]; one page
    of all of them is [num_layers, buffers, page_size, num_kv_heads, head_dim], contiguous.
    """

    dtype: str  # torch dtype name, e.g. "float32"
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    buffers: tuple[str, ...] = ("k", "v")
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("page_size", "num_layers", "num_kv_heads", "head_dim", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KVLayout.tp_rank {self.tp_rank} outside [0, {self.tp_size})")
        if not self.buffers:
            raise ValueError("KVLayout.buffers must name at least one buffer")
        _ = self.torch_dtype  # validates the dtype name

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not a torch dtype")
        return dt

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies in one (layer, buffer)."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in one (layer, buffer)."""
        return self.page_size * self.token_bytes

    @property
    def bytes_per_page_all_layers(self) -> int:
        return self.page_bytes * self.num_layers * len(self.buffers)

    def mismatch(self, other: KVLayout) -> str | None:
        """The first differing field as 'name: ours vs theirs', or None when compatible."""
        for f in fields(self):
            if f.name == "tp_rank":
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                return f"{f.name}: {a!r} vs {b!r}"
        return None

    def to_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> KVLayout:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"KVLayout: unknown fields {sorted(unknown)}")
        kw = dict(d)
        try:
            if "buffers" in kw:
                kw["buffers"] = tuple(kw["buffers"])  # type: ignore[arg-type]
            return cls(**kw)  # type: ignore[arg-type]
        except TypeError as e:  # missing fields or wrong types: the peer's fault
            raise ValueError(f"KVLayout: {e}") from e
