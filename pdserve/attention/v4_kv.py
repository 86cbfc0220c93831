"""DeepSeek-V4's KV over the engine's pool: the model's `StepKV` (attention/step_kv.py) on
the pool's pages (compressed entries) and its state slots (kvcache/state_pool.py).

Sequence b of a step owns the pages of its page-table row and the state slot the runner gave
it (`Batch.host_state_slots`). Entry e of a compressed component lives in the sequence's page
e // rows_per_page, row e % rows_per_page (rows_per_page = page_size / tokens_per_row): the
entries of a page are the windows of that page's tokens, so a page of entries moves with its
tokens' page. Everything here is tensor indexing on the pool's device, with no read back to
the host.

State is rewritten in place, so a step that fails half way would leave it advanced and a rerun
of the same chunk would read rows it already overwrote. Every state write therefore records
the rows it overwrites in the step's journal first; the runner undoes a failed step's writes
(`undo`) before running its chunks again (engine/isolation.py). Entries need no journal: a
rerun writes the same values into the same rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.attention.batch import Batch
from pdserve.attention.step_kv import SeqKV, Span, check_cast
from pdserve.kvcache.pool import KVPool

# State writes of a step: (the slot's component, the index written, its rows before).
Journal = list[tuple[torch.Tensor, slice | torch.Tensor, torch.Tensor]]


def undo(journal: Journal) -> None:
    """Put back every row the journal's writes overwrote, the latest first, and empty it."""
    for slot, index, before in reversed(journal):
        slot[index] = before
    journal.clear()


class PoolSeqKV:
    """Sequence b's components in one layer."""

    def __init__(self, step: PoolStepKV, layer: int, b: int) -> None:
        self.step, self.layer, self.b = step, layer, b

    def state(self, name: str) -> torch.Tensor:
        pool = self.step.pool.state
        assert pool is not None  # PoolStepKV refuses a pool without state
        return pool.view(self.layer, name)[self.step.slots[self.b]]

    def write_state(self, name: str, index: slice | torch.Tensor, values: torch.Tensor) -> None:
        slot = self.state(name)
        self.step.journal.append((slot, index, slot[index].clone()))
        slot[index] = values

    def _view(self, name: str) -> tuple[torch.Tensor, int]:
        view = self.step.pool.view(self.layer, name)  # [num_pages, rows, *shape]
        return view, view.shape[1]

    def buffer_dtype(self, name: str) -> torch.dtype | None:
        layout = self.step.pool.layout
        if name not in {b.name for b in layout.buffers}:
            return None
        return layout.buffer(name).torch_dtype if self.layer in layout.layers_of(name) else None

    def store_rows(self, name: str, first: int, values: torch.Tensor) -> None:
        view, rpp = self._view(name)
        check_cast(name, values, view.dtype)
        if len(values) == 0:
            return
        last = first + len(values) - 1
        if last // rpp >= self.step.own_pages[self.b]:
            raise ValueError(f"{name}: entry {last} is past the sequence's pages")
        idx = torch.arange(first, last + 1, device=view.device)
        pages = self.step.batch.page_table[self.b].long()[idx // rpp]
        view[pages, idx % rpp] = values.to(view.dtype)

    def row_tokens(self, name: str) -> int:
        return self.step.pool.layout.buffer(name).tokens_per_row

    def row(self, name: str, index: int) -> torch.Tensor:
        view, rpp = self._view(name)
        if index // rpp >= self.step.own_pages[self.b]:
            raise ValueError(f"{name}: entry {index} is past the sequence's pages")
        page = self.step.batch.page_table[self.b, index // rpp].long()  # no host read
        return view[page, index % rpp]

    def rows(self, name: str, count: int) -> torch.Tensor:
        view, rpp = self._view(name)
        if count == 0:
            return view.new_empty(0, *view.shape[2:])
        n_pages = -(-count // rpp)
        if n_pages > self.step.own_pages[self.b]:
            raise ValueError(f"{name}: {count} entries are past the sequence's pages")
        pages = self.step.batch.page_table[self.b, :n_pages].long()
        return view.index_select(0, pages).reshape(n_pages * rpp, *view.shape[2:])[:count]


class PoolStepKV:
    """A step's V4 KV: `Span`s from the Batch's host tuples, slots from the runner."""

    def __init__(self, pool: KVPool, batch: Batch, journal: Journal) -> None:
        """`journal`: where state writes record the rows they overwrite (`undo`)."""
        if pool.state is None:
            raise ValueError("DeepSeek-V4 needs a KV pool with per-request state")
        if len(batch.host_state_slots) != batch.num_seqs:
            raise ValueError(
                f"a step of {batch.num_seqs} sequences came with "
                f"{len(batch.host_state_slots)} state slots"
            )
        self.pool, self.batch, self.journal = pool, batch, journal
        self.slots = batch.host_state_slots
        ps = batch.page_size
        self.own_pages = [-(-n // ps) for n in batch.host_kv_lens]  # each sequence's pages
        qs, kv = batch.host_query_start, batch.host_kv_lens
        resumes = batch.host_state_resumes or (False,) * batch.num_seqs
        self._spans = [
            Span(qs[b], qs[b + 1] - qs[b], kv[b] - (qs[b + 1] - qs[b]), resumes[b])
            for b in range(batch.num_seqs)
        ]

    @property
    def spans(self) -> Sequence[Span]:
        return self._spans

    def seq(self, layer: int, b: int) -> SeqKV:
        return PoolSeqKV(self, layer, b)
