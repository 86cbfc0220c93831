"""Triton paged attention on the GPU: correctness against the torch backend, and speed.

    python benchmarks/kernels/attention_kernels.py --out attn.json [--page-size 16] [--iters 50]
                                                   [--quick]

Llama-3.2-1B's attention (32 query heads, 8 KV heads of 64, bfloat16) over a pool of two
layers with shuffled pages (a layer's view is strided across pages, as in serving).

Decode, batch 1, 32 and 128 at contexts of 320 and 4,096 tokens:
  * gpu_ms: GPU time of one layer's attend, L2 flushed before each call (the median over
    --iters): the torch backend's attend (eager; its once-per-step prepare not counted) and
    the triton backend's, replayed from a CUDA graph over a bucket's static buffers (what
    graph decode runs), with the split heuristic's choice;
  * wall_ms: host time per call of back-to-back eager calls (launch overhead included);
  * GB/s: K and V bytes read (every row's context) over triton's gpu_ms, beside a
    device-to-device copy measured in the same run ((read + written bytes) / time);
  * sweeps (not with --quick): split counts, and the decode kernel's block_n, num_warps and
    num_stages, each timed the same way; and 1, 2 or 4 splits with wide key tiles (128, 256).
Prefill: chunks over cached context, torch vs triton, GPU time and TFLOP/s.
Correctness: max |triton - torch| per case (bfloat16 rounding: ~1e-2); a case over
TOLERANCE fails the run (exit 1). Without CUDA it says so and exits 2, unless --smoke: tiny
cases through the same code on the CPU in Triton's interpreter (host-timed, no graphs), a
check of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
if not torch.cuda.is_available():  # --smoke: the kernels run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdserve.attention.batch import Batch, BatchBuilder, SeqSpan  # noqa: E402
from pdserve.attention.decode_bucket import DecodeBuffers  # noqa: E402
from pdserve.attention.torch_backend import TorchBackend  # noqa: E402
from pdserve.attention.triton_backend import TritonBackend  # noqa: E402
from pdserve.attention.triton_decode import paged_decode  # noqa: E402
from pdserve.kvcache.layout import KVLayout  # noqa: E402
from pdserve.kvcache.pool import KVPool  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64  # Llama-3.2-1B
DTYPE = torch.bfloat16
LAYER = 1
TOLERANCE = 3e-2
DECODE_CASES = [(b, ctx) for ctx in (320, 4096) for b in (1, 32, 128)]
PREFILL_CASES = [(1, 512, 0), (1, 512, 3584), (4, 256, 1024)]  # (sequences, chunk, context)
SPLIT_SWEEP = (1, 2, 4, 8, 16, 32)
LAUNCH_SWEEP = [(n, w, s) for n in (32, 64, 128) for w in (2, 4, 8) for s in (2, 3)]
FLUSH_BYTES = 256 << 20  # more than the H200's L2
SMOKE_DECODE, SMOKE_PREFILL = [(2, 40)], [(2, 20, 30)]
ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


class Shape:
    num_heads, num_kv_heads, head_dim = HEADS, KV_HEADS, HEAD_DIM


class Timer:
    """GPU time of a call with a cold L2 (a large buffer written before each call); on the
    CPU (--smoke) host time."""

    def __init__(self, iters: int) -> None:
        self.iters = iters
        self.flush = torch.empty(FLUSH_BYTES if ON_GPU else 1, dtype=torch.uint8, device=DEVICE)

    def gpu_ms(self, fn: Callable[[], object]) -> float:
        for _ in range(3 if ON_GPU else 1):
            fn()
        times = []
        for _ in range(self.iters):
            self.flush.zero_()
            if not ON_GPU:
                start_s = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start_s) * 1e3)
                continue
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def wall_ms(self, fn: Callable[[], object]) -> float:
        """Host time per call, calls back to back, until the device is done with them."""
        fn()
        synchronize()
        start = time.perf_counter()
        for _ in range(self.iters):
            fn()
        synchronize()
        return (time.perf_counter() - start) * 1e3 / self.iters


def synchronize() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` captured once in a CUDA graph (after a warm-up call that compiles); replays it.
    On the CPU (--smoke) `fn` itself, after the same warm-up call."""
    fn()
    if not ON_GPU:
        return fn
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth(timer: Timer, nbytes: int = 1 << 30) -> dict[str, float]:
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    ms = timer.gpu_ms(lambda: dst.copy_(src))
    return {"bytes": nbytes, "ms": ms, "read_plus_write_gbs": 2 * nbytes / ms / 1e6}


class Setup:
    """A pool holding `spans`' pages (shuffled) and this step's q, k, v."""

    def __init__(self, page_size: int, contexts: list[int], chunk: int, seed: int) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        need = [-(-(c + chunk) // page_size) for c in contexts]
        num_pages = sum(need) + 1  # page 0: the page table's padding
        layout = KVLayout.llama("bfloat16", page_size, 2, KV_HEADS, HEAD_DIM)
        self.pool = KVPool(layout, num_pages, DEVICE)
        for i in range(2):
            for cache in self.pool.layer(i):
                cache.copy_(torch.randn(cache.shape, generator=gen, device=DEVICE))
        free = (torch.randperm(num_pages - 1, device="cpu") + 1).tolist()
        spans = []
        for c, n in zip(contexts, need, strict=True):
            spans.append(SeqSpan([1] * chunk, c, [free.pop() for _ in range(n)], True))
        self.batch: Batch = BatchBuilder(page_size, num_pages, DEVICE).build(spans)
        t = self.batch.num_tokens
        self.q = torch.randn(t, HEADS, HEAD_DIM, generator=gen, device=DEVICE).to(DTYPE)
        self.k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen, device=DEVICE).to(DTYPE)
        self.v = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen, device=DEVICE).to(DTYPE)
        self.kv_bytes = sum(c + chunk for c in contexts) * KV_HEADS * HEAD_DIM * 2 * 2


def decode_case(timer: Timer, batch: int, ctx: int, page_size: int, sweeps: Sweeps | None) -> dict:
    s = Setup(page_size, [ctx - 1] * batch, 1, seed=batch * 7 + ctx)
    torch_b, triton_b = TorchBackend(s.pool, Shape), TritonBackend(s.pool, Shape)
    t_meta, x_meta = torch_b.prepare(s.batch), triton_b.prepare(s.batch)
    # The step's K/V are stored once, up front: attend alone is timed (store_kv is separate).
    triton_b.store_kv(LAYER, s.k, s.v, x_meta)
    expected = torch_b.attend(LAYER, s.q, s.k, s.v, t_meta)
    eager = triton_b.attend(LAYER, s.q, s.k, s.v, x_meta)
    max_pages = s.batch.page_table.shape[1]
    assert x_meta.decode is not None
    buffers = triton_b.decode_buffers(batch, max_pages, x_meta.decode.num_splits)
    g_meta = triton_b.prepare_decode_into(s.batch, buffers)
    out: list[torch.Tensor] = []
    replay = graphed(lambda: out.append(triton_b.attend(LAYER, s.q, s.k, s.v, g_meta)))
    replay()
    graph_out = out[-1]
    row: dict[str, Any] = {
        "batch": batch,
        "context": ctx,
        "page_size": page_size,
        "num_splits": buffers.num_splits,
        "kv_bytes": s.kv_bytes,
        "max_abs_diff_vs_torch": (eager.float() - expected.float()).abs().max().item(),
        "graph_equals_eager": bool(torch.equal(graph_out, eager)),
        "torch_gpu_ms": timer.gpu_ms(lambda: torch_b.attend(LAYER, s.q, s.k, s.v, t_meta)),
        "torch_wall_ms": timer.wall_ms(lambda: torch_b.attend(LAYER, s.q, s.k, s.v, t_meta)),
        "triton_gpu_ms": timer.gpu_ms(replay),
        "triton_wall_ms": timer.wall_ms(lambda: triton_b.attend(LAYER, s.q, s.k, s.v, x_meta)),
        "store_kv_gpu_ms": timer.gpu_ms(lambda: triton_b.store_kv(LAYER, s.k, s.v, x_meta)),
    }
    row["triton_gbs"] = s.kv_bytes / row["triton_gpu_ms"] / 1e6
    row["speedup_vs_torch"] = row["torch_gpu_ms"] / row["triton_gpu_ms"]
    if sweeps is not None:
        row["sweep"] = decode_sweep(timer, s, triton_b, max_pages, expected, sweeps)
    return row


class Sweeps(NamedTuple):
    splits: Sequence[int]
    launches: Sequence[tuple[int, int, int]]  # (block_n, num_warps, num_stages)


def decode_sweep(
    timer: Timer,
    s: Setup,
    backend: TritonBackend,
    max_pages: int,
    expected: torch.Tensor,
    sweeps: Sweeps,
) -> list[dict]:
    """The decode kernel alone, per split count (default launch) and per launch setting
    (the heuristic's split count), in CUDA graphs."""
    k_cache, v_cache = s.pool.layer(LAYER)
    rows = s.batch.num_seqs
    heuristic = backend.decode_buffers(rows, max_pages).num_splits
    settings = [(n, 64, 4, 3) for n in sweeps.splits]
    settings += [(heuristic, *x) for x in sweeps.launches]
    # a short context in one or two wide tiles: fewer dependent page-table -> K/V rounds
    settings += [
        (n, b, w, 2)
        for n in (1, 2, 4)
        for b in (128, 256)
        for w in (4, 8)
        if n <= max(sweeps.splits)
    ]
    results = []
    for splits, block_n, warps, stages in settings:
        buffers = backend.decode_buffers(rows, max_pages, num_splits=splits)
        backend.prepare_decode_into(s.batch, buffers)
        out = torch.empty_like(s.q)
        call = launcher(s.q, k_cache, v_cache, buffers, out, backend.scale, block_n, warps, stages)
        ms = timer.gpu_ms(graphed(call))
        results.append(
            {
                "num_splits": splits,
                "block_n": block_n,
                "num_warps": warps,
                "num_stages": stages,
                "gpu_ms": ms,
                "gbs": s.kv_bytes / ms / 1e6,
                "max_abs_diff_vs_torch": (out.float() - expected.float()).abs().max().item(),
            }
        )
    return results


def launcher(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    b: DecodeBuffers,
    out: torch.Tensor,
    scale: float,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> Callable[[], None]:
    """One decode kernel launch (and its reduce) over a bucket's buffers, with these settings."""
    split = b.num_splits > 1

    def call() -> None:
        paged_decode(
            q, k_cache, v_cache, b.page_table, b.kv_lens, out, scale, b.num_splits,
            b.partial_out if split else None, b.partial_lse if split else None,
            block_n=block_n, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip

    return call


def prefill_case(timer: Timer, seqs: int, chunk: int, ctx: int, page_size: int) -> dict:
    s = Setup(page_size, [ctx] * seqs, chunk, seed=seqs * 13 + ctx)
    torch_b, triton_b = TorchBackend(s.pool, Shape), TritonBackend(s.pool, Shape)
    t_meta, x_meta = torch_b.prepare(s.batch), triton_b.prepare(s.batch)
    triton_b.store_kv(LAYER, s.k, s.v, x_meta)
    expected = torch_b.attend(LAYER, s.q, s.k, s.v, t_meta)
    got = triton_b.attend(LAYER, s.q, s.k, s.v, x_meta)
    visible = seqs * sum(ctx + i + 1 for i in range(chunk))  # keys each new token sees
    flops = 4 * HEADS * HEAD_DIM * visible
    row = {
        "sequences": seqs,
        "chunk": chunk,
        "context": ctx,
        "page_size": page_size,
        "max_abs_diff_vs_torch": (got.float() - expected.float()).abs().max().item(),
        "torch_gpu_ms": timer.gpu_ms(lambda: torch_b.attend(LAYER, s.q, s.k, s.v, t_meta)),
        "triton_gpu_ms": timer.gpu_ms(lambda: triton_b.attend(LAYER, s.q, s.k, s.v, x_meta)),
    }
    row["triton_tflops"] = flops / row["triton_gpu_ms"] / 1e9
    row["speedup_vs_torch"] = row["torch_gpu_ms"] / row["triton_gpu_ms"]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="where the JSON results go")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="skip the split and launch sweeps")
    p.add_argument("--smoke", action="store_true", help="tiny cases, to check the script")
    args = p.parse_args()
    if not ON_GPU and not args.smoke:
        print("attention_kernels: needs a CUDA GPU (the torch backend is the CPU's)")
        return 2
    import triton

    decode_cases, prefill_cases = DECODE_CASES, PREFILL_CASES
    sweeps: Sweeps | None = None if args.quick else Sweeps(SPLIT_SWEEP, LAUNCH_SWEEP)
    if args.smoke:
        decode_cases, prefill_cases = SMOKE_DECODE, SMOKE_PREFILL
        sweeps = Sweeps((1, 3), [(32, 2, 2)])
    timer = Timer(args.iters)
    copy = copy_bandwidth(timer, (1 << 30) if ON_GPU else (1 << 20))
    print(f"device-to-device copy: {copy['read_plus_write_gbs']:.0f} GB/s (read + write)")
    decode = []
    for batch, ctx in decode_cases:
        r = decode_case(timer, batch, ctx, args.page_size, sweeps)
        decode.append(r)
        best = min(r.get("sweep", [r]), key=lambda x: x.get("gpu_ms", r["triton_gpu_ms"]))
        print(
            f"decode b={batch:<3} ctx={ctx:<4} splits={r['num_splits']:<2} "
            f"torch {r['torch_gpu_ms']:.3f} ms  triton {r['triton_gpu_ms']:.3f} ms "
            f"({r['speedup_vs_torch']:.1f}x, {r['triton_gbs']:.0f} GB/s = "
            f"{r['triton_gbs'] / copy['read_plus_write_gbs']:.0%} of copy)  "
            f"eager wall {r['triton_wall_ms']:.3f} ms  diff {r['max_abs_diff_vs_torch']:.1e}"
            + (f"  best swept {best.get('gpu_ms', 0):.3f} ms" if "sweep" in r else "")
        )
    prefill = []
    for seqs, chunk, ctx in prefill_cases:
        r = prefill_case(timer, seqs, chunk, ctx, args.page_size)
        prefill.append(r)
        print(
            f"prefill {seqs}x{chunk} over {ctx}: torch {r['torch_gpu_ms']:.3f} ms  "
            f"triton {r['triton_gpu_ms']:.3f} ms ({r['speedup_vs_torch']:.1f}x, "
            f"{r['triton_tflops']:.0f} TFLOP/s)  diff {r['max_abs_diff_vs_torch']:.1e}"
        )
    diffs = [r["max_abs_diff_vs_torch"] for r in decode + prefill]
    diffs += [x["max_abs_diff_vs_torch"] for r in decode for x in r.get("sweep", [])]
    ok = all(d <= TOLERANCE for d in diffs) and all(r["graph_equals_eager"] for r in decode)
    result = {
        "env": {
            "gpu": torch.cuda.get_device_name() if ON_GPU else "none (--smoke, interpreter)",
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bf16"},
        "copy": copy,
        "decode": decode,
        "prefill": prefill,
        "ok": ok,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{'OK' if ok else 'FAILED'}: results in {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
