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

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_cast(name: str, values: torch.Tensor, stored: torch.dtype) -> None:
    """Refuse to store `values` into a buffer of dtype `stored` by a cast that loses its
    meaning: floats into fp8 need a scale, which only the model can make."""
    if stored in FP8 and values.dtype != stored:
        raise ValueError(
            f"store of {values.dtype} values into {stored} component {name!r}: quantise them "
            "first (a plain cast has no scale)"
        )


class Span(NamedTuple):
    """One sequence's share of a step: its new tokens are rows first .. first + length - 1 of
    the step's flat [T, ...] tensors, at positions start .. start + length - 1."""

    first: int
    length: int
    start: int
    # It resumes from a cached prefix this step (start is a page boundary): its state slot is
    # rebuilt first from the state the page before `start` keeps of its end.
    resumes: bool = False


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

    def buffer_dtype(self, name: str) -> torch.dtype | None:
        """The dtype paged component `name` is stored in, in this layer; None if the pool has
        no such component there. How the model learns the storage mode: the layout, not the
        model, decides it (kvcache/v4_layout.py)."""
        ...

    def store_rows(self, name: str, first: int, values: torch.Tensor) -> None:
        """Write entries first .. first + len(values) - 1 of paged component `name` (the
        sequence's entry index, 0 at its first window), converted to the buffer's dtype;
        ValueError for floats into an fp8 buffer (a plain cast has no scale: quantise them
        first)."""
        ...

    def row_tokens(self, name: str) -> int:
        """Tokens per row of paged component `name` (its tokens_per_row)."""
        ...

    def row(self, name: str, index: int) -> torch.Tensor:
        """Entry `index` of paged component `name` as stored: [*shape] (one page read)."""
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
