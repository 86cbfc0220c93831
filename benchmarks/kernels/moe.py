"""DeepSeek-V3's mixture-of-experts layer on the GPU: the fused Triton experts
(kernels/triton_moe.py) against the torch loop (model/moe.py `Experts.loop`), beside the
roofline, at the real expert dims.

    python3 benchmarks/kernels/moe.py --batches 1,32,128 --out moe.json
    python3 benchmarks/kernels/moe.py --sweep       # also every block config: the best per batch
    python3 benchmarks/kernels/moe.py --fp8         # fp8 experts against bf16 ones, N 1..512
    TRITON_INTERPRET=1 python3 benchmarks/kernels/moe.py --device cpu --smoke [--fp8]  # tiny dims

One layer with random weights: H 7168, 256 routed experts of I 2048 (top-8, 8 groups of which
4 are kept), one shared expert of 2048; experts in bfloat16 (22.5 GB), the router in float32.
For each batch of random tokens: both paths' outputs compared (err: the largest difference
over the largest output); ms per layer (router, routed and shared experts) for the torch loop
and the fused path run eagerly, and the fused path replayed in a CUDA graph (the loop cannot
be captured: it reads the routing on the host); the bytes the layer must read (the experts
this batch chose, the shared expert, the router) and those bytes over the copy bandwidth
measured in the same run (roofline_ms). `--smoke` (implied on the CPU) uses tiny dims and
times nothing real.

`--fp8`: the routed experts alone (the same routing for both), fused with bf16 weights and
fused with the same weights block-quantised to fp8 (kernels/triton_moe_fp8.py; 11.3 GB more),
eagerly and replayed in a CUDA graph, at N 1, 32, 128, 512. For each: the bytes the experts
must read (the distinct experts this batch chose times an expert's bytes: bf16, or e4m3 plus
its float32 block scales), that over the copy bandwidth (roofline_ms), and the fraction of it
the graph reaches (of_roofline = roofline_ms / graph_ms); and fp8's difference from bf16
(err: the quantisation's, not a check of the kernel, which the tests make).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.roofline import measure_ceilings, time_steps  # noqa: E402
from pdserve.attention.triton_common import interpreted  # noqa: E402
from pdserve.kernels import fp8_blocks, triton_moe  # noqa: E402
from pdserve.model.deepseek_config import MoEArch  # noqa: E402
from pdserve.model.moe import MoE  # noqa: E402

# DeepSeek-V3's (and V3.2's) experts; and tiny ones for the CPU smoke run
V3 = dict(hidden=7168, num_experts=256, top_k=8, n_group=8, topk_group=4, inter=2048)
TINY = dict(hidden=64, num_experts=8, top_k=2, n_group=2, topk_group=1, inter=32)
# fp8's tiny dims span two scale blocks of H, and I 192 puts gate and up rows in three
TINY_FP8 = dict(hidden=256, num_experts=8, top_k=2, n_group=2, topk_group=1, inter=192)
SWEEP = ((16, 32, 64), (32, 64, 128), (64, 128), (4, 8), (3, 4))  # M, N, K, warps, stages

Layer = Callable[[torch.Tensor], torch.Tensor]


def build(dims: dict[str, int], device: torch.device, dtype: torch.dtype) -> MoE:
    """A MoE layer of `dims` with random weights, built on `device` in `dtype` (the router in
    float32): allocated there directly, never as a float32 copy of 22.5 GB."""
    arch = MoEArch(
        num_experts=dims["num_experts"],
        top_k=dims["top_k"],
        n_group=dims["n_group"],
        topk_group=dims["topk_group"],
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        moe_intermediate_size=dims["inter"],
        n_shared_experts=1,
        first_k_dense_replace=0,
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            layer = MoE(arch, dims["hidden"])
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(0.0, 0.01 if name.endswith("bias") else p.shape[-1] ** -0.5)
    return layer.requires_grad_(False)


def torch_path(layer: MoE) -> Layer:
    def run(x: torch.Tensor) -> torch.Tensor:
        weights, ids = layer.gate(x)
        out = layer.experts.loop(x, ids, weights)
        assert layer.shared_experts is not None
        return out + layer.shared_experts(x)

    return run


def fused_path(layer: MoE, config: triton_moe.Config | None = None) -> Layer:
    def run(x: torch.Tensor) -> torch.Tensor:
        weights, ids = layer.gate(x)
        ex = layer.experts
        out = triton_moe.fused_moe(x, ids, weights, ex.gate_up_proj, ex.down_proj, config)
        assert layer.shared_experts is not None
        return out + layer.shared_experts(x)

    return run


def graphed(fn: Layer, x: torch.Tensor) -> tuple[Callable[[], object], torch.Tensor]:
    """`fn` on a static copy of x captured in a CUDA graph: (replay, its output)."""
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(static)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static)
    return graph.replay, out


def read_bytes(layer: MoE, x: torch.Tensor) -> int:
    """What the layer must read at least: each chosen expert once, the shared expert, the
    router's weight (the tokens and the outputs are noise beside them)."""
    _, ids = layer.gate(x)
    ex = layer.experts
    per_expert = (
        ex.gate_up_proj[0].numel() + ex.down_proj[0].numel()
    ) * ex.down_proj.element_size()
    shared = sum(p.numel() * p.element_size() for p in layer.shared_experts.parameters())  # type: ignore[union-attr]
    router = layer.gate.weight.numel() * layer.gate.weight.element_size()
    return int(ids.unique().numel()) * per_expert + shared + router


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(
        (got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)
    )


def median_ms(fn: Callable[[], object], device: torch.device, n: int) -> float:
    return round(statistics.median(time_steps(fn, device, 3, n)) * 1e3, 4)


def measure(
    layer: MoE, batch: int, device: torch.device, dtype: torch.dtype, n: int, copy_gbps: float
) -> dict[str, Any]:
    hidden = layer.experts.down_proj.shape[1]
    x = torch.randn(batch, hidden, device=device, dtype=dtype)
    loop, fused = torch_path(layer), fused_path(layer)
    nbytes = read_bytes(layer, x)
    cfg = triton_moe.config_for(
        batch, hidden, layer.experts.down_proj.shape[2], layer.gate.moe.top_k,
        layer.gate.moe.num_experts, dtype,
    )  # fmt: skip
    row: dict[str, Any] = {"batch": batch, "config": str(cfg), "err": rel_err(fused(x), loop(x))}
    row["torch_ms"] = median_ms(lambda: loop(x), device, n)
    row["fused_ms"] = median_ms(lambda: fused(x), device, n)
    if device.type == "cuda":
        replay, out = graphed(fused, x)
        replay()
        row["graph_err"] = rel_err(out, fused(x))
        row["fused_graph_ms"] = median_ms(replay, device, n)
    row["read_MB"] = round(nbytes / 1e6, 1)
    row["roofline_ms"] = round(nbytes / (copy_gbps * 1e9) * 1e3, 4)
    best = row.get("fused_graph_ms", row["fused_ms"])
    row["fused_vs_roofline"] = round(best / row["roofline_ms"], 2)
    return row


def sweep(
    layer: MoE, batch: int, device: torch.device, dtype: torch.dtype, n: int
) -> dict[str, Any]:
    """The fastest block config for this batch (eager, the fused experts only)."""
    hidden = layer.experts.down_proj.shape[1]
    x = torch.randn(batch, hidden, device=device, dtype=dtype)
    weights, ids = layer.gate(x)
    ex = layer.experts
    want = ex.loop(x, ids, weights)
    best: tuple[float, triton_moe.Config] | None = None
    for m, bn, bk, warps, stages in itertools.product(*SWEEP):
        cfg = triton_moe.Config(m, bn, bk, warps, stages)

        def run(cfg: triton_moe.Config = cfg) -> torch.Tensor:
            return triton_moe.fused_moe(x, ids, weights, ex.gate_up_proj, ex.down_proj, cfg)

        try:
            if rel_err(run(), want) > 2e-2:
                print(f"  wrong {cfg}", flush=True)
                continue
            t = median_ms(run, device, n)
        except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is skipped
            print(f"  skip {cfg}: {type(exc).__name__}", flush=True)
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
    return {} if best is None else {"best_ms": best[0], "best_config": str(best[1])}


# ---------------------------------------------------------------- fp8 experts


def quantised_experts(layer: MoE) -> tuple[torch.Tensor, ...]:
    """The layer's experts in DeepSeek's fp8 format, filled an expert at a time (the float32
    copy quantize_weight makes is one expert's): (gate_up, gate_up_scale, down, down_scale)."""
    out: list[torch.Tensor] = []
    for w in (layer.experts.gate_up_proj, layer.experts.down_proj):  # [E, O, K]
        q0, s0 = fp8_blocks.quantize_weight(w[0])
        q = torch.empty((w.shape[0], *q0.shape), dtype=q0.dtype, device=w.device)
        scale = torch.empty((w.shape[0], *s0.shape), dtype=s0.dtype, device=w.device)
        for e in range(w.shape[0]):
            q[e], scale[e] = fp8_blocks.quantize_weight(w[e])
        out += [q, scale]
    return tuple(out)


def fp8_row(
    layer: MoE,
    fp8: tuple[torch.Tensor, ...],
    batch: int,
    device: torch.device,
    dtype: torch.dtype,
    n: int,
    copy_gbps: float,
) -> dict[str, Any]:
    """One batch's routed experts, bf16 against fp8 (module docstring, `--fp8`)."""
    ex = layer.experts
    gate_up, gate_up_scale, down, down_scale = fp8
    hidden, inter = ex.down_proj.shape[1:]
    x = torch.randn(batch, hidden, device=device, dtype=dtype)
    weights, ids = layer.gate(x)
    hit = int(ids.unique().numel())

    def bf16(x: torch.Tensor) -> torch.Tensor:
        return triton_moe.fused_moe(x, ids, weights, ex.gate_up_proj, ex.down_proj)

    def fp8_experts(x: torch.Tensor) -> torch.Tensor:
        return triton_moe.fused_moe(
            x, ids, weights, gate_up, down, gate_up_scale=gate_up_scale, down_scale=down_scale
        )

    paths: dict[str, tuple[Layer, int]] = {  # each path, and the bytes of one of its experts
        "bf16": (bf16, ex.gate_up_proj[0].nbytes + ex.down_proj[0].nbytes),
        "fp8": (fp8_experts, sum(t[0].nbytes for t in fp8)),
    }
    row: dict[str, Any] = {"batch": batch, "experts_hit": hit}
    for name, (fn, per_expert) in paths.items():
        row[f"{name}_ms"] = median_ms(functools.partial(fn, x), device, n)
        best = row[f"{name}_ms"]
        if device.type == "cuda":
            replay, _ = graphed(fn, x)
            best = row[f"{name}_graph_ms"] = median_ms(replay, device, n)
        nbytes = hit * per_expert
        row[f"{name}_read_MB"] = round(nbytes / 1e6, 1)
        row[f"{name}_roofline_ms"] = round(nbytes / (copy_gbps * 1e9) * 1e3, 4)
        row[f"{name}_of_roofline"] = round(row[f"{name}_roofline_ms"] / best, 3)
    key = "graph_ms" if device.type == "cuda" else "ms"
    row["fp8_speedup"] = round(row[f"bf16_{key}"] / row[f"fp8_{key}"], 2)
    row["err"] = rel_err(fp8_experts(x), bf16(x))
    cfg = triton_moe.config_for(batch, hidden, inter, ids.shape[1], ex.down_proj.shape[0], fp8=True)
    row["fp8_config"] = str(cfg)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default=None, help="default: 1,32,128 (cuda), 1,3 (cpu)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--steps", type=int, default=20, help="timed calls per measurement")
    parser.add_argument("--sweep", action="store_true", help="time every block config too")
    parser.add_argument("--fp8", action="store_true", help="fp8 experts against bf16 ones")
    parser.add_argument("--smoke", action="store_true", help="tiny dims (implied on the CPU)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    on_gpu = device.type == "cuda"
    if not on_gpu and not interpreted(triton_moe._gate_up_kernel):
        sys.exit("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    smoke = args.smoke or not on_gpu
    dims = (TINY_FP8 if args.fp8 else TINY) if smoke else V3
    default_batches = "1,3" if smoke else "1,32,128,512" if args.fp8 else "1,32,128"
    batches = [int(b) for b in (args.batches or default_batches).split(",")]
    steps = 2 if smoke else args.steps
    torch.manual_seed(0)
    ceilings = measure_ceilings(device, dtype)
    print(f"ceilings: {ceilings}", flush=True)
    layer = build(dims, device, dtype)
    fp8 = quantised_experts(layer) if args.fp8 else ()
    rows = []
    for batch in batches:
        if args.fp8:
            row = fp8_row(layer, fp8, batch, device, dtype, steps, ceilings["copy_GBps"])
        else:
            row = measure(layer, batch, device, dtype, steps, ceilings["copy_GBps"])
        if args.sweep and not args.fp8:
            row.update(sweep(layer, batch, device, dtype, 1 if smoke else args.steps))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(
            json.dumps({"dims": dims, "ceilings": ceilings, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
