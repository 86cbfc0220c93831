"""The model runner: a step's chunks -> one Batch -> the backend's metadata -> logits.

The Batch (pdserve/attention/batch.py) is built on the host once per step and reaches the
device in one staged copy; the attention backend derives its own metadata from it once, and
every layer reuses that. The model sees only tokens, positions and an AttentionContext.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pdserve.attention.backend import AttentionBackend, AttentionContext
from pdserve.attention.batch import Batch, BatchBuilder, SeqSpan
from pdserve.attention.registry import default_backend, make_backend
from pdserve.engine.scheduler import Chunk
from pdserve.kvcache.pool import KVPool
from pdserve.model.llama import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, backend: str | None = None) -> None:
        """`backend`: an attention backend's name (None: the device's default)."""
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.backend: AttentionBackend[Any] = make_backend(
            backend or default_backend(self.device), pool, model.arch
        )
        self.builder = BatchBuilder(pool.page_size, pool.num_pages, self.device)

    def build(self, chunks: Sequence[Chunk]) -> Batch:
        """The step's Batch; chunks in the scheduler's order (decodes first)."""
        return self.builder.build(
            [
                SeqSpan(
                    c.request.all_ids[c.start : c.start + c.length],
                    c.start,
                    c.request.pages,
                    c.samples,
                )
                for c in chunks
            ]
        )

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """Logits [N, vocab] (float32) for the chunks that sample, in chunk order."""
        batch = self.build(chunks)
        ctx = AttentionContext(self.backend, self.backend.prepare(batch))
        hidden = self.model(batch.input_ids, batch.positions, ctx)  # [T, hidden]
        if batch.num_samples == 0:
            return hidden.new_empty(0, self.model.arch.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.sample_indices])
