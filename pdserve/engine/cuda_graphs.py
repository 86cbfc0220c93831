"""CUDA-graph decode: a decode step replayed as one graph per batch-size bucket.

A decode step of a small model is ~1,000 kernel launches and the GPU idles most of it waiting
for the CPU; replayed as one graph, the same ops take a fraction of the time
(benchmarks/RESULTS.md, 2026-12-01). So decode-only steps run as captured graphs:

* **Buckets** 1, 2, 4, 8, then every 8 up to `max_bs` (at most the scheduler's max_running). A
  step of n decodes replays the smallest bucket >= n; rows n.. are padding: token 0 at position
  0, KV length 0 (the attention output is zero) and slot -1 (the store skips it), so padding
  reads nothing and writes nothing.
* **Static inputs.** Each bucket owns its input ids, positions and the attention backend's
  `DecodeBuffers` (KV lengths, a page table as wide as max_model_len, slots, split-KV scratch).
  Per step the Batch (already on the device, one staged upload) is copied into them with a few
  device-to-device copies; nothing waits on the host.
* **Capture** after the KV pool is allocated, largest bucket first, every graph in one memory
  pool (a smaller graph reuses the larger one's activation memory), each after a warm-up run on
  a side stream (Triton compiles its kernels there, outside the capture).
* **What the graph holds:** embedding, every layer, the final norm: hidden states [bs, hidden].
  The LM head runs eagerly on the real rows only, so no bucket keeps a [bs, vocab] buffer.
* A step that carries prefill chunks replays a prefill graph instead (engine/prefill_graphs.py),
  its decodes included. Steps that neither holds, and CPU devices, run eagerly.
  `--enforce-eager` turns graphs off.

The attention backend must offer static decode metadata (`GraphableBackend`); the `triton`
backend does, over k/v (Llama) and over a latent pool (DeepSeek-V3, attention/mla_backend.py).
Its kernels' grids depend only on the bucket's rows and splits, never on lengths. The model
must never wait on the host in its forward (`graph_safe()`: DeepSeek-V3's experts fused).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from pdserve.attention.backend import AttentionContext
from pdserve.attention.batch import Batch
from pdserve.model.loader import LoadedModel

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # before capture: Triton compiles, cuBLAS picks its kernels


@runtime_checkable
class GraphableBackend(Protocol):
    """An attention backend whose decode metadata can live in static buffers."""

    def decode_buffers(self, rows: int, max_pages: int) -> Any: ...

    def decode_metadata(self, buffers: Any) -> Any: ...

    def prepare_decode_into(self, batch: Batch, buffers: Any) -> Any: ...


def bucket_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_bs (max_bs itself always included)."""
    if max_bs < 1:
        return []
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs]
    sizes += list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds n rows; None past the largest."""
    for b in sizes:
        if b >= n:
            return b
    return None


@dataclass
class StepGraph:
    """One bucket's captured forward and the static tensors it reads and writes."""

    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # [rows] int32
    positions: torch.Tensor  # [rows] int32
    buffers: Any  # the backend's static metadata (DecodeBuffers, PrefillBuffers)
    hidden: torch.Tensor  # [rows, hidden]: the graph's output


@dataclass(frozen=True)
class CaptureReport:
    buckets: tuple[int, ...]
    seconds: float
    memory_bytes: int  # device memory the graphs' pool and static buffers took


class BucketGraphs:
    """One kind of graph, one per bucket of rows: what decode and prefill graphs share.
    A kind says how its static metadata is made (`static`) and which rows of a step it runs."""

    what = "step"  # names the kind in the log line

    def __init__(self, model: LoadedModel, backend: Any, max_pages: int, sizes: list[int]) -> None:
        """`max_pages`: the widest page table a sequence may have (max_model_len's pages)."""
        self.model = model
        self.backend = backend
        self.max_pages = max_pages
        self.sizes = sizes
        self.graphs: dict[int, StepGraph] = {}
        self.replays = 0
        self.capture_report: CaptureReport | None = None

    def static(self, rows: int) -> tuple[Any, Any]:
        """The backend's static buffers for a bucket of `rows` and the metadata naming them."""
        raise NotImplementedError

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """The forward captured once per bucket, largest first into one memory pool of this
        kind's own (a smaller graph reuses the larger one's activation memory), each after a
        warm-up on a side stream (Triton compiles, cuBLAS picks its kernels, outside it)."""
        device = next(self.model.parameters()).device
        torch.cuda.synchronize(device)
        start, before = time.monotonic(), torch.cuda.memory_allocated(device)
        pool = torch.cuda.graph_pool_handle()
        for rows in reversed(self.sizes):
            ids = torch.zeros(rows, dtype=torch.int32, device=device)
            positions = torch.zeros(rows, dtype=torch.int32, device=device)
            buffers, metadata = self.static(rows)
            ctx = AttentionContext(self.backend, metadata)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self.model(ids, positions, ctx)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, positions, ctx)
            self.graphs[rows] = StepGraph(graph, ids, positions, buffers, hidden)
        torch.cuda.synchronize(device)
        report = CaptureReport(
            tuple(self.sizes),
            time.monotonic() - start,
            torch.cuda.memory_allocated(device) - before,
        )
        self.capture_report = report
        log.info(
            "CUDA graphs: %d %s buckets (%d..%d) captured in %.1fs, %.0f MiB",
            len(self.sizes),
            self.what,
            self.sizes[0] if self.sizes else 0,
            self.sizes[-1] if self.sizes else 0,
            report.seconds,
            report.memory_bytes / 2**20,
        )
        return report

    def replay(
        self, batch: Batch, rows: slice, prepare: Callable[[Batch, Any], Any]
    ) -> torch.Tensor:
        """Hidden states [n, hidden] of `batch`'s tokens `rows` (n of them, which a bucket
        holds): copied into the smallest such bucket, the rest padding (token 0 at position
        0), its metadata by `prepare(batch, buffers)`, then the graph replayed."""
        ids = batch.input_ids[rows]
        n = ids.shape[0]
        bucket = bucket_for(n, self.sizes)
        assert bucket is not None  # the kind's fits() checked it; not input-dependent
        g = self.graphs[bucket]
        g.input_ids[:n].copy_(ids)
        g.positions[:n].copy_(batch.positions[rows])
        if n < bucket:  # (a torch call saved where the step fills its bucket)
            g.input_ids[n:].zero_()
            g.positions[n:].zero_()
        prepare(batch, g.buffers)
        g.graph.replay()
        self.replays += 1
        return g.hidden[:n]


class DecodeGraphs(BucketGraphs):
    what = "decode"

    def __init__(
        self, model: LoadedModel, backend: GraphableBackend, max_pages: int, max_bs: int
    ) -> None:
        super().__init__(model, backend, max_pages, bucket_sizes(max_bs))

    def static(self, rows: int) -> tuple[Any, Any]:
        buffers = self.backend.decode_buffers(rows, self.max_pages)
        return buffers, self.backend.decode_metadata(buffers)

    def fits(self, batch: Batch) -> bool:
        """Whether a captured bucket holds the step's decodes (its first num_decodes rows)."""
        return (
            bool(self.graphs)
            and 0 < batch.num_decodes <= self.sizes[-1]
            and batch.page_table.shape[1] <= self.max_pages
        )

    def run(self, batch: Batch) -> torch.Tensor:
        """Hidden states [n, hidden] of the n decodes of a batch that `fits` (rows 0 .. n-1;
        any prefill chunks after them are not computed here)."""
        return self.replay(batch, slice(0, batch.num_decodes), self.backend.prepare_decode_into)
