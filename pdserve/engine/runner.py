"""The model runner: a StepPlan -> flat input tensors + attention metadata -> logits.

Index tensors are built on the CPU with torch ops (no per-token Python loops) and moved to
the device once per step; every layer reuses them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.scheduler import Chunk
from pdserve.kvcache.pool import KVPool
from pdserve.model.attention import AttentionContext, PrefillSeq
from pdserve.model.llama import CausalLM


def slots_for(pages: Sequence[int], start: int, end: int, page_size: int) -> torch.Tensor:
    """Flat pool slots of token positions [start, end) of a request holding `pages`."""
    pos = torch.arange(start, end)
    table = torch.tensor(pages, dtype=torch.long)
    return table[pos // page_size] * page_size + pos % page_size


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
            kv_lens = torch.tensor([c.start + 1 for c in decodes])
            max_kv = int(kv_lens.max())
            max_pages = -(-max_kv // ps)
            table = torch.zeros(len(decodes), max_pages, dtype=torch.long)
            for i, c in enumerate(decodes):
                n = -(-(c.start + 1) // ps)
                table[i, :n] = torch.tensor(c.request.pages[:n])
            pos = torch.arange(max_pages * ps)
            ctx.num_decode = len(decodes)
            ctx.decode_pages = table.to(self.device)
            ctx.decode_mask = (pos[None, :] < kv_lens[:, None])[:, None, None, :].to(self.device)
        q_start = len(decodes)
        for c in chunks[len(decodes) :]:
            mask = None
            kv_pages = torch.empty(0, dtype=torch.long)
            if c.start > 0:
                kv_len = c.start + c.length
                n = -(-kv_len // ps)
                kv_pages = torch.tensor(c.request.pages[:n], dtype=torch.long).to(self.device)
                q_pos = torch.arange(c.start, kv_len)
                mask = (torch.arange(kv_len)[None, :] <= q_pos[:, None]).to(self.device)
            prefills.append(PrefillSeq(q_start, c.length, kv_pages, mask))
            q_start += c.length
        ctx.prefills = prefills
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return input_ids, torch.cat(positions).to(self.device), ctx

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
