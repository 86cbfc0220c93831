"""The attention backend interface, and the context that carries it through a forward.

A backend owns everything about attention that is not the model's math: which kernel runs,
the metadata that kernel wants, and how new K/V reach the pool's pages. The model computes
q, k, v and calls, per layer, `rope_store_kv` (RoPE on q and k, then `store_kv`: one kernel
on the triton backend, two ops elsewhere) then `attend`; it never sees the pool or the
metadata's contents.

A model whose attention the backend has no kernel for (DeepSeek's latent attention, in HF's
expanded form) uses the generic pair of a `GatherBackend` instead: `store` writes a named KV
buffer's new tokens (any buffer of the layout, e.g. "latent") and `gather` hands back each
sequence's whole causal context of that buffer, padded, with the index that says which keys
each new token sees (`CausalContext`); the model then attends itself. A `LatentDecodeBackend`
also attends a step of decodes over the latent buffer in MLA's absorbed form, and splits a step
of decodes and prompt chunks so that its decodes do too (`split`).

Per step the runner calls `prepare(batch)` once; every layer then reuses its result (the
metadata), so per-step work (page tables, masks, index arithmetic) is never repeated per
layer. A backend keeps the pool's per-layer KV views from construction on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar, runtime_checkable

import torch

from pdserve.attention.batch import Batch, CausalIndex
from pdserve.kernels import ops

MetaT = TypeVar("MetaT")


class AttentionShape(Protocol):
    """What a backend needs to know of the model (ModelArch has it)."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding for a step's tokens (neox style: each head's two halves)."""

    positions: torch.Tensor  # [T]
    inv_freq: torch.Tensor  # [head_dim / 2] float32 (any scaling already applied)

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] rotated (kernels/ops.rotary: in place on CUDA)."""
        return ops.rotary(q, k, self.positions, self.inv_freq)


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

    def rope_store_kv(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        rope: Rope,
        metadata: MetaT,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope.apply(q, k)` then `store_kv` of the rotated keys; returns the rotated (q, k),
        the keys `attend` is then given. Bit for bit the two steps, fused where it can be."""
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
class CausalContext:
    """What `gather` returns: `values[b, :kv_len[b]]` are sequence b's tokens of one buffer (the
    rest is padding that `mask` hides); `pad`/`unpad` move [T, ...] tensors to [B, Q, ...]."""

    values: torch.Tensor  # [B, L, *buffer shape], the buffer's dtype
    index: CausalIndex

    @property
    def mask(self) -> torch.Tensor:  # [B, Q, L] bool: query slot (b, q) sees key l
        return self.index.mask

    def pad(self, x: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [B, Q, ...]
        return self.index.pad(x)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:  # [B, Q, ...] -> [T, ...]
        return self.index.unpad(y)


class StepSplit(NamedTuple):
    """A step of decodes and prompt chunks, as two steps' metadata (`LatentDecodeBackend.split`).
    The decodes lead the step (attention/batch.py), so its first `decodes` tokens are theirs."""

    decodes: int  # the step's first `decodes` sequences and tokens: its decodes
    decode: Any  # their metadata: `absorbs` holds, the latent verbs serve those rows
    rest: Any  # the other sequences' (tokens numbered from 0): `gather` pads only them


@runtime_checkable
class GatherBackend(Protocol):
    """The generic pair of a backend that can serve attention a model computes itself: today
    the `torch` backend (the runner gives latent-attention models that one)."""

    name: str

    def store(
        self,
        layer: int,
        name: str,  # a buffer of the pool's KV layout present in `layer`
        values: torch.Tensor,  # [T, *buffer shape]: the step's new tokens, in batch order
        metadata: Any,  # the backend's own, from its `prepare`
    ) -> None:
        """Write the new tokens' values of buffer `name` into their pool slots, converted to the
        buffer's dtype; nothing else in the pool changes. Called before `gather`. Values that
        are not already fp8 are refused for an fp8 buffer: quantising needs a scale, which
        is the model's to compute (ValueError)."""
        ...

    def buffer_dtype(self, layer: int, name: str) -> torch.dtype:
        """How the pool stores buffer `name` in `layer` (KeyError if absent): a model whose
        buffer has several storage modes (V3.2's index-K) reads its mode from the pool."""
        ...

    def gather(self, layer: int, name: str, metadata: Any) -> CausalContext:
        """Each sequence's whole causal context of buffer `name` (its cached tokens and this
        step's, as stored), padded to the step's longest, with the index of who sees what."""
        ...


@runtime_checkable
class LatentDecodeBackend(GatherBackend, Protocol):
    """A GatherBackend that also attends a step of decodes over MLA's latent buffer in the
    absorbed form (model/mla_absorbed.py): today the `triton` backend of a latent pool
    (attention/mla_backend.py)."""

    def absorbs(self, metadata: Any) -> bool:
        """Whether this step's latent attention runs absorbed (`attend_latent`): a step of
        decodes only. Else the model gathers and attends in the expanded form."""
        ...

    def split(self, metadata: Any) -> StepSplit | None:
        """A step of decodes and prompt chunks in two (None for any other step): the decodes
        attend absorbed with `decode`, the rest expanded with `rest`, so that `gather` pads
        only the prompts' sequences. Each part's `store` writes that part's tokens only; the
        whole step's metadata stores every token's (one call for the latents)."""
        ...

    def attend_latent(
        self,
        layer: int,
        q_latent: torch.Tensor,  # [T, H, R]: each head's non-rotary query through W_UK
        q_rope: torch.Tensor,  # [T, H, P]: its rotated query
        scale: float,
        metadata: Any,
        picked: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [T, H, R], q_latent's dtype
        """Each decode's softmax((q_latent . c + q_rope . k_rope) * scale) . c over its
        sequence's latent rows [c (R) | k_rope (P)], this step's included (stored first);
        `picked` (positions [T, K], counts [T]: `index_topk`'s): over those rows only."""
        ...

    def index_topk(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, D] float32: the indexer's queries (fp8 form: quantised)
        weights: torch.Tensor,  # [T, H] float32: their head weights, scales folded in
        qk_scale: float,
        topk: int,
        metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, K] int32 positions, [T] int32 counts)
        """DeepSeek-V3.2's picks on a decode step: each decode's `topk` best keys by its
        index scores over the layer's index-K (attention/triton_index_scores.py), this
        step's key included (stored first)."""
        ...


@dataclass(frozen=True)
class AttentionContext(Generic[MetaT]):
    """The one scoped object that carries attention into a model's forward: the backend and
    this step's metadata from its `prepare`. Built by the runner per step, never kept."""

    backend: AttentionBackend[MetaT]
    metadata: MetaT


AnyContext = AttentionContext[Any]
