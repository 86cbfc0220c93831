"""CUDA-graph prefill: a step's prefill chunks replayed as one graph per token-count bucket.

Launched eagerly, a forward costs the host ~0.7 ms a layer on an H200 (the Python side of
each Triton launch and cuBLAS call), whatever the tokens: 11-12 ms for a 1.2B Llama's
256-token prompt, whose GPU work is about 1 ms (benchmarks/mixed_step.py). Every decoding
request waits through the tick that carries a prompt, so under a steady arrival of prompts
that tick sets the inter-token latency. So the chunks of a step replay a captured graph,
as its decodes do (engine/cuda_graphs.py): a mixed step is the decode graph of its decodes,
then the prefill graph of its chunks, one after the other on the stream.

* **Buckets** of new tokens: 16, 32, 64, 128, then every 128 up to 1,024, then every 256 up
  to the largest (`--cuda-graph-max-tokens`, at most the step budget). A step's chunks replay
  the smallest bucket that holds their tokens, if they are at most `MAX_SEQS` chunks and their
  page tables fit; else the whole step runs eagerly.
* **Static inputs** per bucket: ids, positions and the backend's `PrefillBuffers` (slots,
  query starts from 0, KV lengths, page tables as wide as max_model_len). Per step the
  chunks' part of the staged Batch is copied in on the device; padded tokens are token 0 at
  position 0 with slot -1 (stored nowhere, attended by no program: their hidden rows are
  never read), padded sequences have no tokens.
* **Capture** after the KV pool and the decode graphs, largest bucket first, into a memory
  pool of their own (a mixed step replays a decode graph and a prefill graph back to back;
  neither may reuse the other's memory), each after a warm-up run on a side stream.
* **What the graph holds:** embedding, every layer, the final norm: hidden states [tokens,
  hidden]. The LM head and prompt scoring run eagerly on the rows they need.

A bucket's token count sets the matrix products' shapes, so a chunk's bits may differ from
an eager run of the same chunk by cuBLAS's choice of kernel for that shape (as a decode
bucket's padding does); graph and eager runs are checked token for token on the GPU
(tests/engine/test_prefill_graphs.py).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from pdserve.attention.batch import Batch
from pdserve.engine.cuda_graphs import BucketGraphs, bucket_for
from pdserve.model.llama import CausalLM

MAX_SEQS = 64  # chunks a prefill graph holds; a step of more runs eagerly


@runtime_checkable
class PrefillGraphableBackend(Protocol):
    """An attention backend whose prefill metadata can live in static buffers."""

    def prefill_buffers(self, tokens: int, seqs: int, max_pages: int) -> Any: ...

    def prefill_metadata(self, buffers: Any) -> Any: ...

    def prepare_prefill_into(self, batch: Batch, buffers: Any) -> Any: ...


def token_bucket_sizes(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, then every 128 to 1,024, then every 256 (max_tokens itself included)."""
    if max_tokens < 1:
        return []
    steps = [16, 32, 64, *range(128, 1025, 128), *range(1280, max_tokens + 1, 256)]
    sizes = [t for t in steps if t <= max_tokens]
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


class PrefillGraphs(BucketGraphs):
    what = "prefill"

    def __init__(
        self, model: CausalLM, backend: PrefillGraphableBackend, max_pages: int, max_tokens: int
    ) -> None:
        super().__init__(model, backend, max_pages, token_bucket_sizes(max_tokens))

    def static(self, rows: int) -> tuple[Any, Any]:
        buffers = self.backend.prefill_buffers(rows, min(rows, MAX_SEQS), self.max_pages)
        return buffers, self.backend.prefill_metadata(buffers)

    def fits(self, batch: Batch) -> bool:
        """Whether a captured bucket holds the step's prefill chunks (the rows after its
        decodes)."""
        seqs = batch.num_seqs - batch.num_decodes
        bucket = bucket_for(batch.num_tokens - batch.num_decodes, self.sizes)
        return (
            bucket is not None
            and 0 < seqs <= min(bucket, MAX_SEQS)
            and batch.page_table.shape[1] <= self.max_pages
        )

    def run(self, batch: Batch) -> torch.Tensor:
        """Hidden states [t, hidden] of the t tokens of the prefill chunks of a batch that
        `fits` (rows num_decodes .. num_tokens-1)."""
        return self.replay(batch, slice(batch.num_decodes, None), self.backend.prepare_prefill_into)
