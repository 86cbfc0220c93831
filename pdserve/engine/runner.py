"""The model runner: a step's chunks -> one Batch -> the backend's metadata -> logits.

The Batch (pdserve/attention/batch.py) is built on the host once per step and reaches the
device in one staged copy; the attention backend derives its own metadata from it once, and
every layer reuses that. The model sees only tokens, positions and an AttentionContext. On
CUDA, a decode-only step replays a captured graph instead (engine/cuda_graphs.py) when the
backend supports it and graphs are on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from pdserve.attention.backend import AttentionBackend, AttentionContext
from pdserve.attention.batch import Batch, BatchBuilder, SeqSpan
from pdserve.attention.registry import default_backend, make_backend
from pdserve.engine.cuda_graphs import DecodeGraphs, GraphableBackend
from pdserve.engine.scheduler import Chunk
from pdserve.kvcache.pool import KVPool
from pdserve.model.llama import CausalLM

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        backend: str | None = None,
        *,
        cuda_graph_max_bs: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        """`backend`: an attention backend's name (None: the device's default).
        `cuda_graph_max_bs`: capture decode graphs up to this batch (0: run eagerly; CUDA and a
        graph-capable backend only); `max_model_len` bounds their page tables."""
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.backend: AttentionBackend[Any] = make_backend(
            backend or default_backend(self.device), pool, model.arch
        )
        self.builder = BatchBuilder(pool.page_size, pool.num_pages, self.device)
        self.graphs: DecodeGraphs | None = None
        if cuda_graph_max_bs > 0 and self.device.type == "cuda":
            if not isinstance(self.backend, GraphableBackend):
                log.info(
                    "attention backend %s has no static metadata: decode runs eagerly",
                    self.backend.name,
                )
            else:
                max_len = max_model_len or pool.capacity_tokens
                max_pages = -(-min(max_len, pool.capacity_tokens) // pool.page_size)
                self.graphs = DecodeGraphs(model, self.backend, max_pages, cuda_graph_max_bs)
                self.graphs.capture()

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
        if self.graphs is not None and self.graphs.fits(batch):
            return self.model.compute_logits(self.graphs.run(batch))  # every decode samples
        ctx = AttentionContext(self.backend, self.backend.prepare(batch))
        hidden = self.model(batch.input_ids, batch.positions, ctx)  # [T, hidden]
        if batch.num_samples == 0:
            return hidden.new_empty(0, self.model.arch.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.sample_indices])
