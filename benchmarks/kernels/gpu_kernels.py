"""Where a decode forward's GPU time goes, kernel by kernel, beside its wall time (one GPU).

    python benchmarks/kernels/gpu_kernels.py --models llama3.2-1b-shape --batches 1,32,128 \
        --out k.json
    python benchmarks/kernels/gpu_kernels.py --models llama3.2-1b-shape --batches 128 --prefill 256
    python benchmarks/kernels/gpu_kernels.py --device cpu --models tiny --batches 2 --ctx 40 # smoke

For each model and batch the engine prefills B random `--ctx`-token prompts (as
benchmarks/engine/gpu_decode.py does), plans one decode step, then runs `ModelRunner.forward`
over it `--steps` times under torch.profiler (CUDA graphs on, as served; the profiler sees each
kernel of a replayed graph). Reported per step: the forward's period on the stream (CUDA events, no
profiler), the sum of its kernels' times, their count, and the kernels grouped by what they
do (GEMMs, attention, the fused elementwise kernels, the sampler's, copies), with the top
kernels by time. `gap` = period - kernel time: where the GPU idles between kernels
(launch latency, host waits). The weight GEMMs' bandwidth = the weights' bytes / GEMM time,
against the copy bandwidth measured in the same run; `matmul_roofline_ms` = the step's weight
FLOPs over the bf16 matmul rate measured then.

`--prefill P` profiles a mixed step instead: the B decodes and one new prompt's P-token chunk
in one forward, as a serving tick that admits a prompt runs it (one prefill graph of B + P
tokens with the decodes in its decode section, engine/prefill_graphs.py, when a bucket holds
it): where the time of the ticks that carry a prompt goes.

Kernels launched with programmatic dependent launch (pdserve/kernels/pdl.py) start before the
kernel ahead of them ends and wait on the device: the profiler counts that wait in their time,
so kernel times can add up to more than the period (a negative `gap`). `PDSERVE_PDL=0` in the
environment gives each kernel its own time, at the cost of the gaps PDL hides.

`--step tick` profiles whole engine steps instead (`Engine.tick()` with overlapped scheduling,
as served: the forward plus the sampler, the step's uploads and the device->host copy of the
ids), and splits the GPU's idle time by the length of each idle stretch: many short gaps are
launch latency, a few long ones a host wait.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.gpu_decode import (  # noqa: E402
    check_none_ended,
    decode_chunks,
    decode_engine,
    prefill,
)
from benchmarks.engine.mixed_step import with_prompt  # noqa: E402
from benchmarks.kernels.roofline import measure_ceilings, time_steps  # noqa: E402
from pdserve.model.builtin import resolve_model  # noqa: E402

GROUPS = [  # (group, pattern on the kernel's name), first match wins
    ("gemm", r"gemm|gemv|cutlass|nvjet|sm90_|sm100_|ampere_|matmul|splitK"),
    ("attention", r"paged|attend|decode_kernel|prefill_kernel|_reduce_kernel|flash|sdpa|_attn"),
    ("fused elementwise", r"rms|norm|rotary|silu|store|add_"),
    ("sampler", r"gumbel|argmax|topk|sort|softmax|max_"),
    ("copy", r"[Mm]emcpy|[Mm]emset|copy|cat|index"),
]


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name):
            return group
    return "other"


def kernel_table(prof: Any, steps: int, cuda: bool) -> list[dict[str, Any]]:
    """The CUDA kernels (and memcpys) the profiler saw, per step: [{name, ms, count}]. On the
    CPU (a smoke run of this script): the aten ops' own CPU time instead."""
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if cuda and ev.device_type == torch.autograd.DeviceType.CUDA:
            t = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        elif not cuda and ev.name.startswith("aten::"):
            t = ev.self_cpu_time_total
        else:
            continue
        r = rows[ev.name]
        r[0] += t
        r[1] += 1
    return sorted(
        (
            {"name": n, "ms": t / 1e3 / steps, "count": c / steps, "group": group_of(n)}
            for n, (t, c) in rows.items()
        ),
        key=lambda r: -r["ms"],
    )


BINS = (("<5us", 5.0), ("5-20us", 20.0), ("20-100us", 100.0), (">100us", float("inf")))


def idle_stretches(prof: Any, steps: int) -> dict[str, float]:
    """The GPU's idle time per step between the first and the last kernel the profiler saw,
    split by stretch length (µs): {"<5us": ms, "5-20us": ms, "20-100us": ms, ">100us": ms}."""
    spans = sorted(
        (ev.time_range.start, ev.time_range.end)
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CUDA
    )
    bins = {k: 0.0 for k, _ in BINS}
    if not spans:
        return bins
    end = spans[0][1]
    for start, stop in spans[1:]:
        idle = start - end
        if idle > 0:
            key = next(k for k, top in BINS if idle < top)
            bins[key] += idle
        end = max(end, stop)
    return {k: round(v / 1e3 / steps, 4) for k, v in bins.items()}


def bench(name: str, args: argparse.Namespace, ceilings: dict[str, float]) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    path = resolve_model(f"builtin:{name}")
    ticks = args.step == "tick"
    out_len = 64 + (3 * args.steps + 16 if ticks else 0)  # ticks decode: never end in the run
    engine = decode_engine(path, args, max_len=args.ctx + out_len, prompt=args.prefill)
    weights = [p for p in engine.model.parameters() if p.dim() == 2]
    weight_bytes = sum(p.numel() * p.element_size() for p in weights)
    # the weights' matmuls: 2 FLOPs per weight per token, the LM head's for the sampling rows
    # only (a prompt's chunk samples its last), the embedding lookup none; attention left out
    arch = engine.model.arch
    head = arch.vocab_size * arch.hidden_size
    body = sum(p.numel() for p in weights) - head * (1 if arch.tie_word_embeddings else 2)
    out = []
    for batch in args.batches:
        ended: dict[str, str] = {}
        ids = prefill(engine, batch, args.ctx, out_len, ended)
        engine.sync()
        check_none_ended(ended)
        chunks = decode_chunks(engine, ids)
        if args.prefill:
            chunks = with_prompt(engine, args.prefill, seed=batch)
        flops = 2 * (body * sum(c.length for c in chunks) + head * len(chunks))
        step: Any = lambda c=chunks: engine.runner.forward(c)  # noqa: E731
        if ticks:
            engine.overlap, step = True, engine.tick
        period = statistics.median(time_steps(step, device, 5, args.steps))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        engine.sync()
        check_none_ended(ended)
        kernels = kernel_table(prof, args.steps, device.type == "cuda")
        by_group: dict[str, float] = defaultdict(float)
        for k in kernels:
            by_group[k["group"]] += k["ms"]
        busy = sum(k["ms"] for k in kernels)
        gemm_s = by_group["gemm"] / 1e3
        row = {
            "model": name,
            "batch": batch,
            "prefill_tokens": args.prefill,
            "step": args.step,
            "period_ms": round(period * 1e3, 4),
            "kernel_ms": round(busy, 4),
            "gap_ms": round(period * 1e3 - busy, 4),
            "kernels_per_step": round(sum(k["count"] for k in kernels), 1),
            "idle_ms": idle_stretches(prof, args.steps) if device.type == "cuda" else None,
            "groups_ms": {g: round(v, 4) for g, v in sorted(by_group.items(), key=lambda x: -x[1])},
            "gemm_GBps": round(weight_bytes / gemm_s / 1e9, 1) if gemm_s else None,
            "copy_GBps": ceilings["copy_GBps"],
            "matmul_roofline_ms": round(flops / (ceilings["matmul_TFLOPs"] * 1e9), 4),
            "top": [{**k, "ms": round(k["ms"], 4)} for k in kernels[: args.top]],
        }
        print(json.dumps({k: v for k, v in row.items() if k != "top"}), flush=True)
        for k in row["top"]:
            print(f"    {k['ms']:8.4f} ms  x{k['count']:5.1f}  {k['group']:18s} {k['name'][:110]}")
        out.append(row)
        for rid in ids + ([f"p{batch}"] if args.prefill else []):
            engine.abort(rid)
        engine.tick()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama3.2-1b-shape")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--ctx", type=int, default=320)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument(
        "--step",
        choices=("forward", "tick"),
        default="forward",
        help="profile ModelRunner.forward, or whole overlapped Engine.tick() steps",
    )
    ap.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="forward only: the step carries one prompt's chunk of this many tokens beside "
        "the decodes (a mixed step, one prefill graph when a bucket holds it)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.prefill and args.step == "tick":
        ap.error("--prefill profiles a forward: a tick would advance the prompt")
    args.batches = [int(b) for b in args.batches.split(",") if b]
    if not torch.cuda.is_available() and args.device.startswith("cuda"):
        print("no CUDA device: run with --device cpu for a smoke run (aten ops)", file=sys.stderr)
        return 2
    ceilings = measure_ceilings(torch.device(args.device), getattr(torch, args.dtype))
    print(json.dumps({"ceilings": ceilings}), flush=True)
    rows = [r for m in args.models.split(",") for r in bench(m, args, ceilings)]
    if args.out:
        Path(args.out).write_text(json.dumps({"ceilings": ceilings, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
