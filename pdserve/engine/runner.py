"""The model runner: a StepPlan -> flat input tensors + attention metadata -> logits.

Index tensors are built on the CPU with torch ops (no per-token Python loops) and moved to
the device once per step; every layer reuses them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.scheduler import Chunk
from pdserve.kvcache.pool import KVPool
from pdserve.model.attention import AttentionContext, DecodeGroup, PrefillSeq
from pdserve.model.llama import CausalLM


def slots_for(pages: Sequence[int], start: int, end: int, page_size: int) -> torch.Tensor:
    """Flat pool slots of token positions [start, end) of a request holding `pages`."""
    pos = torch.arange(start, end)
    table = torch.tensor(pages, dtype=torch.long)
    return table[pos // page_size] * page_size + pos % page_size


def group_by_length(kv_lens: Sequence[int], page_size: int) -> list[list[int]]:
    """Decode rows in groups, longest first, each holding every remaining row with more than
    half the pages of the group's longest: padding a row to its group's length at most doubles
    its attention work, where one batch padded to the longest row could multiply it by 10.
    """
    pages = [-(-n // page_size) for n in kv_lens]
    order = sorted(range(len(kv_lens)), key=lambda i: -pages[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and 2 * pages[i] > pages[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.kv_caches = [pool.layer(i) for i in range(pool.layout.num_layers)]

    def build(self, chunks: Sequence[Chunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
        """Chunks must come decodes (length 1) first, as the scheduler orders them."""
        ps = self.pool.page_size
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        decodes = [c for c in chunks if c.length == 1]
        prefills: list[PrefillSeq] = []
        for c in chunks:
            toks = c.request.all_ids[c.start : c.start + c.length]
            ids.extend(toks)
            positions.append(torch.arange(c.start, c.start + c.length))
            slots.append(slots_for(c.request.pages, c.start, c.start + c.length, ps))
        ctx = AttentionContext(slot_mapping=torch.cat(slots).to(self.device))
        if decodes:
            ctx.num_decode = len(decodes)
            groups = group_by_length([c.start + 1 for c in decodes], ps)
            if len(groups) == 1:  # every row, in step order: no index to gather or scatter by
                ctx.decode_groups = [self._decode_group(decodes, None)]
            else:
                ctx.decode_groups = [self._decode_group([decodes[i] for i in g], g) for g in groups]
        q_start = len(decodes)
        for c in chunks[len(decodes) :]:
            mask = kv_pages = None
            if c.start > 0:
                kv_len = c.start + c.length
                pages = c.request.pages[: self.pool.pages_needed(kv_len)]
                kv_pages = torch.tensor(pages, dtype=torch.long).to(self.device)
                q_pos = torch.arange(c.start, kv_len)
                mask = (torch.arange(kv_len)[None, :] <= q_pos[:, None]).to(self.device)
            prefills.append(PrefillSeq(q_start, c.length, kv_pages, mask))
            q_start += c.length
        ctx.prefills = prefills
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return input_ids, torch.cat(positions).to(self.device), ctx

    def _decode_group(self, group: Sequence[Chunk], rows: list[int] | None) -> DecodeGroup:
        """Page table and mask of the decode chunks `group`; `rows`: their places among the
        step's decode tokens (None: they are all of them, in step order)."""
        lens = [c.start + 1 for c in group]
        max_pages = self.pool.pages_needed(max(lens))
        table = []
        for c, n in zip(group, lens, strict=True):
            pages = c.request.pages[: self.pool.pages_needed(n)]
            table.append(pages + [0] * (max_pages - len(pages)))  # page 0 pads, masked out
        pos = torch.arange(max_pages * self.pool.page_size)
        mask = (pos[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
        return DecodeGroup(
            torch.tensor(rows).to(self.device) if rows is not None else None,
            torch.tensor(table, dtype=torch.long).to(self.device),
            mask.to(self.device),
        )

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """Logits [N, vocab] (float32) for the chunks that sample, in chunk order."""
        input_ids, positions, ctx = self.build(chunks)
        hidden = self.model(input_ids, positions, self.kv_caches, ctx)
        ends = []
        offset = 0
        for c in chunks:
            offset += c.length
            if c.samples:
                ends.append(offset - 1)
        if not ends:
            return hidden.new_empty(0, self.model.arch.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden[torch.tensor(ends, device=hidden.device)])
