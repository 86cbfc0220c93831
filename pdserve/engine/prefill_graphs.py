"""CUDA-graph prefill: a step that carries prefill chunks, its decodes included, replayed as
one graph per bucket of its tokens.

Launched eagerly, a forward costs the host a fixed time a layer (the Python side of each
Triton launch and cuBLAS call), whatever the tokens, several times a prompt's GPU work
(benchmarks/engine/mixed_step.py; benchmarks/RESULTS.md, 2026-12-03). Every decoding request waits
through the tick that carries a prompt, so under a steady arrival of prompts that tick sets
the inter-token latency. So such a step replays a captured graph, as a decode-only step does
(engine/cuda_graphs.py). The step's decodes are rows of the same graph: one forward reads the
weights once for decodes and chunks together (a decode graph followed by a graph of the chunks
alone read them twice and paid each layer's kernels twice: benchmarks/RESULTS.md, 2026-12-04).

* **Buckets** of tokens, decodes included: 16, 32, 64, 128, then every 128 up to 1,024,
  then every 256 up to the largest (`--cuda-graph-max-tokens`, at most the step budget). A
  step replays the smallest bucket that holds its tokens, if its decodes fit the bucket's
  decode section (up to the largest decode bucket), its chunks are at most `MAX_SEQS` and
  their page tables fit; else the whole step runs eagerly.
* **Static inputs** per bucket: ids, positions and the backend's `PrefillBuffers`: every
  token's slot, a decode section (KV lengths and page tables of up to min(tokens, largest
  decode bucket) rows, split-KV scratch) and the chunks' query starts, KV lengths and page
  tables, all as wide as max_model_len. Per step the staged Batch is copied in on the device;
  padded tokens are token 0 at position 0 with slot -1 (stored nowhere; their hidden rows are
  never read), padded sequences have no tokens (no prefill program attends them), padded
  decode rows KV length 0 (the decode kernel reads no key for them and writes zeros).
* **Capture** after the KV pool and the decode graphs, largest bucket first, into a memory
  pool of their own, each after a warm-up run on a side stream.
* **What the graph holds:** embedding, every layer, the final norm: hidden states [tokens,
  hidden]. The LM head and prompt scoring run eagerly on the rows they need.

A bucket's token count sets the matrix products' shapes, so a row's bits may differ from an
eager run of the same step by cuBLAS's choice of kernel for that shape (as a decode bucket's
padding does); graph and eager runs are checked token for token on the GPU
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

    def prefill_buffers(self, tokens: int, seqs: int, max_pages: int, decodes: int) -> Any: ...

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
        self,
        model: CausalLM,
        backend: PrefillGraphableBackend,
        max_pages: int,
        max_tokens: int,
        max_decodes: int,
    ) -> None:
        """`max_decodes`: the most decodes a step replayed here may carry (0: none)."""
        super().__init__(model, backend, max_pages, token_bucket_sizes(max_tokens))
        self.max_decodes = max_decodes

    def static(self, rows: int) -> tuple[Any, Any]:
        decodes = min(rows, self.max_decodes)
        buffers = self.backend.prefill_buffers(rows, min(rows, MAX_SEQS), self.max_pages, decodes)
        return buffers, self.backend.prefill_metadata(buffers)

    def fits(self, batch: Batch) -> bool:
        """Whether a captured bucket holds the step: its tokens, its decodes in the bucket's
        decode section, its prefill chunks (at least one) and their page tables."""
        nd, seqs = batch.num_decodes, batch.num_seqs - batch.num_decodes
        bucket = bucket_for(batch.num_tokens, self.sizes)
        return (
            bucket is not None
            and nd <= min(bucket, self.max_decodes)
            and 0 < seqs <= min(bucket, MAX_SEQS)
            and batch.page_table.shape[1] <= self.max_pages
        )

    def run(self, batch: Batch) -> torch.Tensor:
        """Hidden states [T, hidden] of every token of a step that `fits`."""
        return self.replay(batch, slice(0, None), self.backend.prepare_prefill_into)
