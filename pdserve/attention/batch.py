"""The batch description: one step's tokens and sequences, as every attention backend reads it.

The runner turns a step's chunks into `SeqSpan`s and `BatchBuilder.build` turns those into one
`Batch`, on the host, once per step; its tensors reach the device in one staged copy
(`staging.py`); decodes keep their page-table rows from step to step (`page_table.py`). A
backend derives its own metadata from the Batch (`AttentionBackend.prepare`); nothing here is
specific to one attention kernel.

Layout (the scheduler's order): the first `num_decodes` sequences are decodes, one new token
each; prefill chunks follow. The step's tokens are flat, sequence after sequence, so sequence
b's new tokens are rows query_start[b] .. query_start[b+1] of every [T, ...] tensor.

Page table: row b holds sequence b's first pages_needed(kv_lens[b]) pages in token order, then
page 0 as padding up to the widest row. Padding is only ever read under a mask (or not at all),
so which page pads does not matter; 0 is simply a valid index.

Every integer here is int32 (FlashAttention's cu_seqlens and block tables, Triton's page
tables): `BatchBuilder` refuses a pool whose slots would not fit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pdserve.attention.page_table import PageTable
from pdserve.attention.staging import Staging

INDEX_DTYPE = torch.int32
MAX_INDEX = 2**31 - 1


class SeqSpan(NamedTuple):
    """One sequence's share of a step: `token_ids` are computed at positions start, start+1, ..
    on top of `start` tokens whose K/V is already in the pool."""

    token_ids: Sequence[int]  # the new tokens
    start: int  # context length: tokens already in the pool
    pages: Sequence[int]  # the sequence's pages in token order; enough for start + new tokens
    samples: bool  # whether its last token's logits are wanted
    # Whose sequence it is, the same object from step to step (the runner's Request): a decode
    # keeps its page-table row between steps (page_table.py). None: a row for this build only.
    owner: object | None = None


class Decodes(NamedTuple):
    """A step's decodes as columns, one entry per sequence (each computes one token at
    `starts[i]`): the runner's form of most rows of a large step."""

    token_ids: list[int]
    starts: list[int]
    pages: list[Sequence[int]]  # each sequence's pages in token order
    samples: list[bool]
    owners: list[object]  # whose persistent page-table row each uses (page_table.py)


@dataclass(frozen=True)
class Batch:
    """B sequences, T new tokens. Tensors are on the device (views of one staged upload, valid
    until the next build); the host tuples let a backend plan shapes without a device read."""

    input_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32: each token's position in its sequence
    slot_mapping: torch.Tensor  # [T] int32: pool slot (page * page_size + offset) of its K/V
    query_start: torch.Tensor  # [B+1] int32: cu_seqlens of the new tokens
    query_lens: torch.Tensor  # [B] int32: new tokens per sequence
    kv_lens: torch.Tensor  # [B] int32: context + new tokens per sequence
    page_table: torch.Tensor  # [B, max_pages] int32: see the module doc (padded with page 0)
    sample_indices: torch.Tensor  # [N] int32: the last token of each sequence that samples
    num_decodes: int  # sequences 0 .. num_decodes-1 are decodes (one token each)
    page_size: int
    host_query_start: tuple[int, ...]  # [B+1]
    host_kv_lens: tuple[int, ...]  # [B]
    extra: tuple[torch.Tensor, ...] = ()  # BatchBuilder.build's `extra` lists, on the device
    # [B]: each sequence's per-request state slot (kvcache/state_pool.py; DeepSeek-V4), or ()
    host_state_slots: tuple[int, ...] = ()
    # [B]: whether each sequence resumes from a cached prefix this step (its state is rebuilt
    # from the page before it), or ()
    host_state_resumes: tuple[bool, ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.host_kv_lens)

    @property
    def num_tokens(self) -> int:
        return self.host_query_start[-1]

    @property
    def num_samples(self) -> int:
        return self.sample_indices.shape[0]

    @property
    def max_query_len(self) -> int:
        return max(self.host_query_len(b) for b in range(self.num_seqs))

    @property
    def max_kv_len(self) -> int:
        return max(self.host_kv_lens)

    def host_query_len(self, b: int) -> int:
        return self.host_query_start[b + 1] - self.host_query_start[b]

    def sequences_from(self, first: int) -> Batch:
        """Sequences `first`.. as a Batch of their own (their tokens renumbered from 0), for
        attention metadata over part of a step (attention/mla_backend.py: a mixed step's prompt
        chunks apart from its decodes). Views and one device subtraction, no device read;
        without samples or `extra` (attention reads neither)."""
        if not 0 <= first < self.num_seqs:
            raise ValueError(f"sequences from {first} of a batch of {self.num_seqs}")
        t0 = self.host_query_start[first]
        return Batch(
            input_ids=self.input_ids[t0:],
            positions=self.positions[t0:],
            slot_mapping=self.slot_mapping[t0:],
            query_start=self.query_start[first:] - t0,
            query_lens=self.query_lens[first:],
            kv_lens=self.kv_lens[first:],
            page_table=self.page_table[first:],
            sample_indices=self.sample_indices[:0],
            num_decodes=max(self.num_decodes - first, 0),
            page_size=self.page_size,
            host_query_start=tuple(q - t0 for q in self.host_query_start[first:]),
            host_kv_lens=self.host_kv_lens[first:],
            host_state_slots=self.host_state_slots[first:],
            host_state_resumes=self.host_state_resumes[first:],
        )


class BatchBuilder:
    """Builds each step's Batch and uploads it through one persistent `Staging`.

    Decodes (the leading one-token spans: most rows of a large step) are built as columns:
    their page-table rows persist between steps in a `PageTable`, synced by the pages added
    since (page_table.py), so a decode costs a few appends and the rest is numpy over the
    batch. Prefill chunks are built a sequence (and for slots a page) at a time."""

    def __init__(
        self,
        page_size: int,
        num_pages: int,
        device: torch.device,
        gone: Callable[[object], bool] = lambda _owner: False,
    ) -> None:
        """`gone(owner)`: whether a span's owner left for good (its row may be reused)."""
        if num_pages * page_size > MAX_INDEX:
            raise ValueError(
                f"a pool of {num_pages} pages of {page_size} tokens has slots past int32 "
                f"({num_pages * page_size} > {MAX_INDEX}); use fewer pages"
            )
        self.page_size = page_size
        self.staging = Staging(device, INDEX_DTYPE)
        self.table = PageTable(gone)

    def release(self, owner: object) -> None:
        """`owner`'s sequence left: its page-table row may be reused."""
        self.table.release(owner)

    def build(self, spans: Sequence[SeqSpan], extra: Sequence[Sequence[int]] = ()) -> Batch:
        """Spans in step order; the leading one-token spans are the decodes. `extra`: more
        int lists to upload in the same copy, as `Batch.extra`."""
        if not spans:
            raise ValueError("a batch needs at least one sequence")
        nd = 0
        while nd < len(spans) and len(spans[nd].token_ids) == 1:
            nd += 1
        dec = spans[:nd]
        decodes = Decodes(
            [s.token_ids[0] for s in dec],
            [s.start for s in dec],
            [s.pages for s in dec],
            [s.samples for s in dec],
            [s if s.owner is None else s.owner for s in dec],  # a span: a row for this build
        )
        try:
            return self.build_step(decodes, spans[nd:], extra)
        finally:
            for s in dec:
                if s.owner is None:
                    self.table.release(s)

    def build_step(
        self,
        decodes: Decodes,
        prefills: Sequence[SeqSpan],
        extra: Sequence[Sequence[int]] = (),
        state_slots: Sequence[int] = (),
        state_resumes: Sequence[bool] = (),
    ) -> Batch:
        """The step's decodes, as columns, then its other spans (`build`: the same from spans;
        the runner's per-step call). `state_slots`: each sequence's state slot, in the same
        order, for a pool that keeps per-request state, and whether each resumes from a cached
        prefix (`state_resumes`)."""
        nd = len(decodes.starts)
        if nd + len(prefills) == 0:
            raise ValueError("a batch needs at least one sequence")
        if state_slots and len(state_slots) != nd + len(prefills):
            raise ValueError(f"{len(state_slots)} state slots for {nd + len(prefills)} sequences")
        ps = self.page_size
        # Decodes: one token, one slot and one persistent page-table row each.
        ids = list(decodes.token_ids)
        starts = decodes.starts
        rows = self.table.sync_all(decodes.owners, decodes.pages, [p // ps + 1 for p in starts])
        samples = [b for b, s in enumerate(decodes.samples) if s]
        d_pos = np.array(starts, dtype=np.int64)
        d_need = d_pos // ps + 1
        # Prefill chunks: their tokens, positions and slots a page at a time.
        positions: list[int] = []
        slots: list[int] = []
        query_start = list(range(nd + 1))
        kv_lens = [p + 1 for p in starts]
        p_tables: list[Sequence[int]] = []
        for s in prefills:
            end = s.start + len(s.token_ids)
            need = -(-end // ps)
            if len(s.pages) < need:
                raise ValueError(
                    f"a sequence of {s.start} + {end - s.start} tokens needs {need} pages of "
                    f"{ps} tokens, it holds {len(s.pages)}"
                )
            pages = s.pages[:need]  # a copy of a list (SeqSpan.pages may be a live view)
            ids.extend(s.token_ids)
            positions.extend(range(s.start, end))
            pos = s.start
            while pos < end:  # one run of consecutive slots per page
                page, offset = divmod(pos, ps)
                run = min(ps - offset, end - pos)
                first = pages[page] * ps + offset
                slots.extend(range(first, first + run))
                pos += run
            p_tables.append(pages)
            kv_lens.append(end)
            query_start.append(query_start[-1] + end - s.start)
            if s.samples:
                samples.append(query_start[-1] - 1)
        width = max([len(t) for t in p_tables] + ([int(d_need.max())] if nd else []))
        table = np.zeros((nd + len(prefills), width), dtype=np.int32)
        if nd:
            self.table.gather(rows, d_need, table[:nd])
        for b, pages in enumerate(p_tables, start=nd):
            table[b, : len(pages)] = pages
        d_slots = table[np.arange(nd), d_pos // ps].astype(np.int64) * ps + d_pos % ps
        q_lens = np.diff(np.array(query_start))
        parts: list[Sequence[int] | np.ndarray] = [
            ids,
            np.concatenate([d_pos, np.array(positions, dtype=np.int64)]),
            np.concatenate([d_slots, np.array(slots, dtype=np.int64)]),
            query_start,
            q_lens,
            kv_lens,
            table.reshape(-1),
            samples,
            *extra,
        ]
        up = self.staging.upload(parts)
        return Batch(
            input_ids=up[0],
            positions=up[1],
            slot_mapping=up[2],
            query_start=up[3],
            query_lens=up[4],
            kv_lens=up[5],
            page_table=up[6].view(nd + len(prefills), width),
            sample_indices=up[7],
            num_decodes=nd,
            page_size=ps,
            host_query_start=tuple(query_start),
            host_kv_lens=tuple(kv_lens),
            extra=tuple(up[8:]),
            host_state_slots=tuple(state_slots),
            host_state_resumes=tuple(state_resumes),
        )


@dataclass(frozen=True)
class CausalIndex:
    """Where each new token sits among its sequence's causal context, for attention that a model
    computes itself over gathered keys (attention/backend.py `gather`): B sequences, at most Q new
    tokens and L keys each. Derived from a Batch on its device, without a device read."""

    rows: torch.Tensor  # [T] int64: each new token's sequence b
    cols: torch.Tensor  # [T] int64: its index among b's new tokens
    mask: torch.Tensor  # [B, Q, L] bool: query slot (b, q) sees key l (False for padding slots)
    pages: torch.Tensor  # [B, pages_needed(L)]: each sequence's pages in token order, padded
    max_kv_len: int  # L

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] in batch order -> [B, Q, ...], zeros in the padding slots."""
        b, q = self.mask.shape[:2]
        out = x.new_zeros(b, q, *x.shape[1:])
        out[self.rows, self.cols] = x
        return out

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """[B, Q, ...] -> [T, ...] in batch order (the inverse of `pad`)."""
        return y[self.rows, self.cols]


def causal_index(batch: Batch) -> CausalIndex:
    """Token t of sequence b, at position p, sees keys 0..p of b: the cached context and this
    step's tokens up to itself."""
    device = batch.positions.device
    num_seqs, q, length = batch.num_seqs, batch.max_query_len, batch.max_kv_len
    seqs = torch.arange(num_seqs, device=device)
    rows = torch.repeat_interleave(seqs, batch.query_lens.long(), output_size=batch.num_tokens)
    cols = torch.arange(batch.num_tokens, device=device) - batch.query_start.long()[rows]
    pos = torch.full((num_seqs, q), -1, dtype=torch.long, device=device)  # -1: sees nothing
    pos[rows, cols] = batch.positions.long()
    mask = torch.arange(length, device=device)[None, None, :] <= pos[:, :, None]
    pages = batch.page_table[:, : -(-length // batch.page_size)]
    return CausalIndex(rows, cols, mask, pages, length)
