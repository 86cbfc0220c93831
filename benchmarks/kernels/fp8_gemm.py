"""DeepSeek-V3's fp8 layer products on the GPU: pdserve's Triton fp8 linear (kernels/triton_fp8.py:
act_quant, then the block-scaled GEMM) against cuBLAS in bfloat16 (F.linear) on the dequantised
weight, beside the HBM roofline measured in the same run.

    python3 benchmarks/kernels/fp8_gemm.py --out fp8.json
    python3 benchmarks/kernels/fp8_gemm.py --sweep --out fp8_sweep.json   # also block configs
    TRITON_INTERPRET=1 python3 benchmarks/kernels/fp8_gemm.py --device cpu --smoke [--sweep]
        # a check that the script runs: tiny shapes in the interpreter, no measurement

For each weight (O x K, the real layer shapes) and M rows of bfloat16 x: µs per product for
each path, the speedup, the bytes the fp8 product must read (the fp8 weight, its scales, x)
and how close its time comes to reading them at the copy bandwidth (roofline: bytes over
bandwidth, over the time), its TFLOP/s, and the largest difference of its output from the
bfloat16 product's (max |d|, and over the largest output). Each product runs over enough
distinct copies of its weight (together larger than the L2 cache, as a model's layers are)
in sequence inside one CUDA graph, replayed `--replays` times; the median replay over the
copies is the time. `--sweep` times every block config of SWEEP for each (shape, M) and prints
the best per row and, per M, the config with the best geometric mean over the shapes:
the data `triton_fp8.config_for` is chosen from.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.roofline import measure_ceilings, time_calls  # noqa: E402
from pdserve.attention.triton_common import interpreted  # noqa: E402
from pdserve.kernels import fp8_blocks, triton_fp8  # noqa: E402

# DeepSeek-V3's weights, (O, K): attention's q_a, kv_a (with its rope part), q_b, o; the first
# dense layers' MLP; a MoE layer's shared expert
V3_SHAPES = {
    "q_a": (1536, 7168),
    "kv_a": (576, 7168),
    "q_b": (24576, 1536),
    "o": (7168, 16384),
    "dense_gate_up": (36864, 7168),
    "dense_down": (7168, 18432),
    "shared_gate_up": (4096, 7168),
    "shared_down": (7168, 2048),
}
SMOKE_SHAPES = {"wide": (300, 200), "narrow": (130, 384)}  # every last block cut short
L2_FLUSH_BYTES = 256 * 2**20  # the weight copies a product cycles over: 5x an H100's L2
# (BLOCK_M, BLOCK_N, num_warps, num_stages, split_k); BLOCK_M is kept to sizes that suit M
# and split K to grids short of programs (sweep_configs)
SWEEP = ((16, 32, 64, 128), (16, 32, 64, 128), (4, 8), (3, 4, 5), (1, 2, 4, 8))
SMOKE_SWEEP = ((16,), (16, 64), (4,), (2,), (1, 2))

Call = Callable[[], object]


class Weights:
    """One layer weight in both forms, each as `copies` distinct tensors: fp8 with its block
    scales (a copy pairs the two), and the dequantised weight in bfloat16 for cuBLAS."""

    def __init__(self, o: int, k: int, copies: int, device: torch.device) -> None:
        w = torch.randn(o, k, device=device) / k**0.5
        q, scale = fp8_blocks.quantize_weight(w)
        del w
        dense = fp8_blocks.dequantize_weight(q, scale).bfloat16()
        self.fp8 = [(q.clone(), scale.clone()) for _ in range(copies)]
        self.bf16 = [dense.clone() for _ in range(copies)]
        self.read_bytes = q.numel() + scale.numel() * scale.element_size()  # per product, + x


def fp8_calls(x: torch.Tensor, weights: Weights, config: triton_fp8.Config | None) -> list[Call]:
    """The Triton fp8 linear of x with each weight copy."""
    return [
        lambda q=q, scale=scale: triton_fp8.linear(x, q, scale, config) for q, scale in weights.fp8
    ]


def measure(
    name: str, o: int, k: int, m: int, weights: Weights, args: argparse.Namespace, gbps: float
) -> dict[str, Any]:
    device = torch.device(args.device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    q, scale = weights.fp8[0]
    got = triton_fp8.linear(x, q, scale).float()
    want = F.linear(x, weights.bf16[0]).float()
    diff = float((got - want).abs().max())
    fp8_s = time_calls(fp8_calls(x, weights, None), args.replays, device)
    bf16_s = time_calls([lambda w=w: F.linear(x, w) for w in weights.bf16], args.replays, device)
    nbytes = weights.read_bytes + x.numel() * x.element_size()
    row: dict[str, Any] = {
        "shape": name,
        "O": o,
        "K": k,
        "M": m,
        "fp8_us": round(fp8_s * 1e6, 2),
        "bf16_us": round(bf16_s * 1e6, 2),
        "speedup": round(bf16_s / fp8_s, 2),
        "fp8_read_MB": round(nbytes / 1e6, 2),
        "roofline": round(nbytes / (gbps * 1e9) / fp8_s, 3),
        "fp8_TFLOPs": round(2 * m * o * k / fp8_s / 1e12, 1),
        "max_abs_diff": round(diff, 5),
        "rel_diff": round(diff / float(want.abs().max().clamp_min(1e-30)), 5),
        "config": str(triton_fp8.config_for(m, o, k)),
    }
    if args.sweep:
        row["sweep"] = sweep(x, weights, got, args)
    return row


def sweep_configs(m: int, o: int, grid: tuple[tuple[int, ...], ...]) -> list[triton_fp8.Config]:
    """The grid's configs whose BLOCK_M suits M rows: at most M rounded up (no block mostly
    padding), and at least a quarter of it (up to 128), so a prefill is not cut in slivers;
    split K only where the grid without it has fewer than TARGET_PROGRAMS programs."""
    fit = max(16, 1 << (m - 1).bit_length())
    return [
        triton_fp8.Config(bm, bn, warps, stages, split)
        for bm, bn, warps, stages, split in itertools.product(*grid)
        if min(fit, 128) // 4 <= bm <= fit
        and (split == 1 or -(-m // bm) * -(-o // bn) < triton_fp8.TARGET_PROGRAMS)
    ]


def sweep(
    x: torch.Tensor, weights: Weights, want: torch.Tensor, args: argparse.Namespace
) -> dict[str, float]:
    """µs per product of every config that compiles and agrees with the default's output."""
    device = torch.device(args.device)
    out: dict[str, float] = {}
    grid = SMOKE_SWEEP if args.smoke else SWEEP
    for cfg in sweep_configs(x.shape[0], weights.fp8[0][0].shape[0], grid):
        q, scale = weights.fp8[0]
        try:
            got = triton_fp8.linear(x, q, scale, cfg).float()
            if float((got - want).abs().max()) > 1e-2 * float(want.abs().max()):
                print(f"  wrong {cfg}", flush=True)
                continue
            seconds = time_calls(fp8_calls(x, weights, cfg), args.replays, device)
            out[str(cfg)] = round(seconds * 1e6, 2)
        except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is skipped
            print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| shape | O x K | M | fp8 µs | bf16 µs | speedup | fp8 read MB | roofline | "
        "fp8 TFLOP/s | max abs diff (rel) | config |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['O']} x {r['K']} | {r['M']} | {r['fp8_us']} | {r['bf16_us']} "
            f"| {r['speedup']} | {r['fp8_read_MB']} | {r['roofline']:.0%} | {r['fp8_TFLOPs']} "
            f"| {r['max_abs_diff']} ({r['rel_diff']}) | {r['config']} |"
        )
    return "\n".join(lines)


def sweep_summary(rows: list[dict[str, Any]]) -> str:
    """Per row the fastest config; per M the config with the best geometric mean of its time
    over the default's, among those timed on every shape."""
    lines = ["| shape | M | default µs | best µs | best config |", "|---|---|---|---|---|"]
    per_m: dict[int, dict[str, list[float]]] = {}
    for r in rows:
        timed = r.get("sweep") or {}
        if not timed:
            continue
        best = min(timed, key=timed.__getitem__)
        lines.append(f"| {r['shape']} | {r['M']} | {r['fp8_us']} | {timed[best]} | {best} |")
        for cfg, us in timed.items():
            per_m.setdefault(r["M"], {}).setdefault(cfg, []).append(us / r["fp8_us"])
    lines += ["", "| M | best over all shapes | geomean time / default's |", "|---|---|---|"]
    for m, ratios in sorted(per_m.items()):
        shapes = max(len(v) for v in ratios.values())
        full = {c: v for c, v in ratios.items() if len(v) == shapes}
        geo = {c: math.exp(statistics.fmean(map(math.log, v))) for c, v in full.items()}
        best = min(geo, key=geo.__getitem__)
        lines.append(f"| {m} | {best} | {geo[best]:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--m", default="1,32,128,512", help="rows of x, comma-separated")
    parser.add_argument("--shapes", default=",".join(V3_SHAPES), help="names in V3_SHAPES")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: the script runs")
    parser.add_argument("--sweep", action="store_true", help="time block configs too")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu" and not interpreted(triton_fp8._block_linear_kernel):
        sys.exit("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    if args.smoke:
        shapes, ms, args.replays = SMOKE_SHAPES, [1, 5], 1
    else:
        shapes = {name: V3_SHAPES[name] for name in args.shapes.split(",")}
        ms = [int(m) for m in args.m.split(",")]
    torch.manual_seed(0)
    ceilings = measure_ceilings(device, torch.bfloat16)
    print(f"ceilings: {ceilings}", flush=True)
    rows = []
    for name, (o, k) in shapes.items():
        copies = 1 if args.smoke else max(1, -(-L2_FLUSH_BYTES // (o * k)))
        weights = Weights(o, k, copies, device)
        for m in ms:
            row = measure(name, o, k, m, weights, args, ceilings["copy_GBps"])
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "sweep"}), flush=True)
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(table(rows))
    if args.sweep:
        print()
        print(sweep_summary(rows))
    if args.out:
        args.out.write_text(json.dumps({"ceilings": ceilings, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
