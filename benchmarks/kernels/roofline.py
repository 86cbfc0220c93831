"""The hardware's ceilings and a decode step's roofline, measured in the run that uses them
(benchmarks/engine/gpu_decode.py, benchmarks/kernels/gpu_kernels.py).

* `time_steps`: seconds per call, call by call, between CUDA events on the stream (host time
  on the CPU);
* `measure_ceilings`: the device-to-device copy bandwidth ((read + written bytes) / time) and
  the matmul rate in a dtype, now;
* `step_cost` / `roofline`: the bytes a decode step must move (the weights once, a tied head
  once; the KV read and written) and the FLOPs it must do, over those ceilings.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from pdserve.engine.engine import Engine


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(fn: Callable[[], object], device: torch.device, warmup: int, n: int) -> list[float]:
    """Seconds per call of `fn`, call by call, after `warmup` calls. On CUDA each interval is
    between events recorded on the stream around the call: GPU time when the GPU is the
    bottleneck, launch time when the host is."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type != "cuda":
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    events[0].record()
    for i in range(n):
        fn()
        events[i + 1].record()
    sync(device)
    return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(n)]


# ---------------------------------------------------------------- ceilings and roofline


def measure_ceilings(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """The device-to-device copy bandwidth (bytes read + written per second) and the matmul
    rate in `dtype` (FLOP/s), measured now."""
    on_gpu = device.type == "cuda"
    nbytes = 2**30 if on_gpu else 2**26
    copy_s = _median_copy_s(nbytes, device)
    n = 8192 if on_gpu else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    mm_s = statistics.median(time_steps(lambda: a @ b, device, 3, 10))
    return {
        "copy_bytes": nbytes,
        "copy_GBps": round(2 * nbytes / copy_s / 1e9, 1),
        "matmul_n": n,
        "matmul_TFLOPs": round(2 * n**3 / mm_s / 1e12, 2),
    }


def _median_copy_s(nbytes: int, device: torch.device) -> float:
    """Seconds to copy `nbytes` from one device buffer to another (both freed on return)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return statistics.median(time_steps(lambda: dst.copy_(src), device, 3, 10))


def step_cost(engine: Engine, batch: int, ctx: float) -> tuple[int, int]:
    """(bytes, FLOPs) a decode step of `batch` rows at mean context `ctx` must move and do."""
    model, arch = engine.model, engine.model.arch
    params = dict(model.named_parameters())  # a tied head is here once, as the embedding
    embed = params["model.embed_tokens.weight"]
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    matmul_weights = sum(p.numel() for p in params.values() if p.dim() == 2)
    if not arch.tie_word_embeddings:  # the lookup reads `batch` rows of its table, no matmul
        weight_bytes -= (embed.numel() - batch * arch.hidden_size) * embed.element_size()
        matmul_weights -= embed.numel()
    layout = engine.pool.layout
    kv_bytes = int(batch * (ctx + 1) * layout.page_bytes / layout.page_size)  # ctx read, 1 written
    attn_flops = int(4 * batch * ctx * arch.num_layers * arch.num_heads * arch.head_dim)
    return weight_bytes + kv_bytes, 2 * batch * matmul_weights + attn_flops


def roofline(cost: tuple[int, int], ceilings: dict[str, float]) -> dict[str, float]:
    nbytes, flops = cost
    mem_s = nbytes / (ceilings["copy_GBps"] * 1e9)
    flop_s = flops / (ceilings["matmul_TFLOPs"] * 1e12)
    return {
        "bytes_per_step": nbytes,
        "flops_per_step": flops,
        "roofline_mem_ms": round(mem_s * 1e3, 4),
        "roofline_flop_ms": round(flop_s * 1e3, 4),
        "roofline_ms": round(max(mem_s, flop_s) * 1e3, 4),
    }


def time_calls(calls: list[Callable[[], object]], replays: int, device: torch.device) -> float:
    """Seconds per call: every call once, in sequence, in a CUDA graph (a loop on the CPU);
    the median of `replays` replays."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(replays):
            for call in calls:
                call()
        return (time.perf_counter() - t0) / (replays * len(calls))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up (compiles) outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times) / len(calls)
