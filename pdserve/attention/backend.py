"""The attention backend interface, and the context that carries it through a forward.

A backend owns everything about attention that is not the model's math: which kernel runs,
the metadata that kernel wants, and how new K/V reach the pool's pages. The model computes
q, k, v (and RoPE) and calls, per layer, `store_kv` then `attend`; it never sees the pool or
the metadata's contents.

Per step the runner calls `prepare(batch)` once; every layer then reuses its result (the
metadata), so per-step work (page tables, masks, index arithmetic) is never repeated per
layer. A backend keeps the pool's per-layer KV views from construction on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from pdserve.attention.batch import Batch

MetaT = TypeVar("MetaT")


class AttentionShape(Protocol):
    """What a backend needs to know of the model (ModelArch has it)."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


class AttentionBackend(Protocol[MetaT]):
    name: str

    def prepare(self, batch: Batch) -> MetaT:
        """This step's metadata, shared by every layer. Reads the Batch's tensors without
        waiting on the device (its host tuples give every shape)."""
        ...

    def store_kv(
        self,
        layer: int,
        k: torch.Tensor,  # [T, Hkv, D]: the step's new keys, in batch token order
        v: torch.Tensor,  # [T, Hkv, D]
        metadata: MetaT,
    ) -> None:
        """Write the new tokens' K/V into their pool slots (`Batch.slot_mapping`), converted to
        the pool's dtype; nothing else in the pool changes. Called before `attend`."""
        ...

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]: the same new keys store_kv was given
        v: torch.Tensor,  # [T, Hkv, D]
        metadata: MetaT,
    ) -> torch.Tensor:  # [T, Hq, D], q's dtype
        """Causal attention of each new token over its sequence's keys: the context in the pool
        and the new tokens up to itself. GQA: query head h reads KV head h // (Hq / Hkv)."""
        ...


@dataclass(frozen=True)
class AttentionContext(Generic[MetaT]):
    """The one scoped object that carries attention into a model's forward: the backend and
    this step's metadata from its `prepare`. Built by the runner per step, never kept."""

    backend: AttentionBackend[MetaT]
    metadata: MetaT


AnyContext = AttentionContext[Any]
