"""DeepSeek-V4's view of the KV store: a step's sequences (`Span`) and, per sequence and layer,
its per-request state and compressed entries (`SeqKV`), behind `StepKV`.

The model (model/deepseek_v4/) reads and writes its KV only through these; the torch backend
serves them over the pool (attention/v4_kv.py), and model/deepseek_v4/kv.py over plain tensors
(the model's unit tests). kvcache/v4_layout.py names the components.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch


class Span(NamedTuple):
    """One sequence's share of a step: its new tokens are rows first .. first + length - 1 of
    the step's flat [T, ...] tensors, at positions start .. start + length - 1."""

    first: int
    length: int
    start: int


class SeqKV(Protocol):
    """One sequence's KV in one layer, during one step."""

    def state(self, name: str) -> torch.Tensor:
        """The sequence's slot of state component `name` in this layer, [*shape], to read:
        write it only through `write_state`."""
        ...

    def write_state(self, name: str, index: slice | torch.Tensor, values: torch.Tensor) -> None:
        """state(name)[index] = values, kept to the next step; the pool's implementation
        journals the rows it overwrites, so a step that fails can be undone."""
        ...

    def store_rows(self, name: str, first: int, values: torch.Tensor) -> None:
        """Write entries first .. first + len(values) - 1 of paged component `name` (the
        sequence's entry index, 0 at its first window), converted to the buffer's dtype."""
        ...

    def rows(self, name: str, count: int) -> torch.Tensor:
        """Entries 0 .. count - 1 of paged component `name` as stored: [count, *shape]."""
        ...


class StepKV(Protocol):
    """A step's sequences and their KV."""

    @property
    def spans(self) -> Sequence[Span]: ...

    def seq(self, layer: int, b: int) -> SeqKV: ...


@runtime_checkable
class V4KVBackend(Protocol):
    """An attention backend that can serve V4 (the engine's torch backend): the model's
    forward calls `step_kv(ctx.metadata)` once per step."""

    name: str

    def step_kv(self, metadata: Any) -> StepKV: ...
