"""What DeepSeek-V4's attention needs of the KV store (the protocols live in
attention/step_kv.py, re-exported here), and a plain-tensor implementation of them.

V4's KV is not one paged K/V pair (kvcache/v4_layout.py names the components): per layer it
appends compressed entries to paged rows, and it rewrites a per-request state slot (the
sliding-window ring, the compressors' tails and overlap) every step. The model reads and
writes them through `StepKV.seq(layer, b)`, one sequence at a time; the engine's torch
backend implements it over the pool's pages and the state pool's slots, and `LocalStepKV`
below over plain tensors, one sequence per entry (the model's unit tests, against HF).

Positions decide everything: a sequence's step computes tokens start .. start + n - 1, and the
rows of its state and entries that hold data follow from `start` alone, so the model never
reads a row it has not written for this sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdserve.attention.step_kv import SeqKV, Span, StepKV, V4KVBackend, check_cast
from pdserve.kvcache.buffer_spec import BufferSpec
from pdserve.kvcache.v4_layout import StateSpec

__all__ = ["LocalSeqKV", "LocalStepKV", "SeqKV", "Span", "StepKV", "V4KVBackend"]


@dataclass
class LocalSeqKV:
    """One sequence's every component in plain tensors: `state[(layer, name)]` and
    `entries[(layer, name)]` (grown as entries arrive)."""

    buffers: dict[str, BufferSpec]
    states: dict[str, StateSpec]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    slots: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    entries: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    def view(self, layer: int) -> _LayerView:
        return _LayerView(self, layer)


class _LayerView:
    def __init__(self, owner: LocalSeqKV, layer: int) -> None:
        self.owner, self.layer = owner, layer

    def state(self, name: str) -> torch.Tensor:
        key = (self.layer, name)
        if key not in self.owner.slots:
            spec = self.owner.states[name]
            if self.layer not in spec.layers:
                raise KeyError(f"layer {self.layer} has no state {name!r}")
            # NaN, not zeros: a model that reads a row it did not write fails loudly.
            self.owner.slots[key] = torch.full(
                spec.shape, float("nan"), dtype=getattr(torch, spec.dtype), device=self.owner.device
            )
        return self.owner.slots[key]

    def write_state(self, name: str, index: slice | torch.Tensor, values: torch.Tensor) -> None:
        self.state(name)[index] = values

    def buffer_dtype(self, name: str) -> torch.dtype | None:
        spec = self.owner.buffers.get(name)
        if spec is None or (spec.layers is not None and self.layer not in spec.layers):
            return None
        return spec.torch_dtype

    def store_rows(self, name: str, first: int, values: torch.Tensor) -> None:
        spec = self.owner.buffers[name]
        check_cast(name, values, spec.torch_dtype)
        key = (self.layer, name)
        have = self.owner.entries.get(key)
        if have is None:
            have = torch.empty(0, *spec.shape, dtype=spec.torch_dtype, device=self.owner.device)
        if first != len(have):
            raise ValueError(f"{name}: entries arrive in order (have {len(have)}, got {first})")
        self.owner.entries[key] = torch.cat([have, values.to(spec.torch_dtype)])

    def row_tokens(self, name: str) -> int:
        return self.owner.buffers[name].tokens_per_row

    def row(self, name: str, index: int) -> torch.Tensor:
        return self.rows(name, index + 1)[index]

    def rows(self, name: str, count: int) -> torch.Tensor:
        have = self.owner.entries.get((self.layer, name))
        n = 0 if have is None else len(have)
        if count > n:
            raise ValueError(f"{name}: {count} entries asked, {n} stored")
        if have is None:
            spec = self.owner.buffers[name]
            return torch.empty(0, *spec.shape, dtype=spec.torch_dtype, device=self.owner.device)
        return have[:count]


class LocalStepKV:
    """A step over `LocalSeqKV`s: sequence b of the step is `seqs[b]`."""

    def __init__(self, seqs: Sequence[LocalSeqKV], spans: Sequence[Span]) -> None:
        if len(seqs) != len(spans):
            raise ValueError("one LocalSeqKV per span")
        self.seqs, self._spans = list(seqs), list(spans)

    @property
    def spans(self) -> Sequence[Span]:
        return self._spans

    def seq(self, layer: int, b: int) -> SeqKV:
        return self.seqs[b].view(layer)
