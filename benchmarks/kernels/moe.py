"""DeepSeek-V3's mixture-of-experts layer on the GPU: the fused Triton experts
(kernels/triton_moe.py) against the torch loop (model/moe.py `Experts.loop`), beside the
roofline, at the real expert dims.

    python3 benchmarks/kernels/moe.py --batches 1,32,128 --out moe.json
    python3 benchmarks/kernels/moe.py --sweep       # also every block config: the best per batch
    TRITON_INTERPRET=1 python3 benchmarks/kernels/moe.py --device cpu  # a smoke run, tiny dims

One layer with random weights: H 7168, 256 routed experts of I 2048 (top-8, 8 groups of which
4 are kept), one shared expert of 2048; experts in bfloat16 (22.5 GB), the router in float32.
For each batch of random tokens: both paths' outputs compared (err: the largest difference
over the largest output); ms per layer (router, routed and shared experts) for the torch loop
and the fused path run eagerly, and the fused path replayed in a CUDA graph (the loop cannot
be captured: it reads the routing on the host); the bytes the layer must read (the experts
this batch chose, the shared expert, the router) and those bytes over the copy bandwidth
measured in the same run (roofline_ms). `--device cpu` uses tiny dims and times nothing real.
"""

from __future__ import annotations

import argparse
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
from pdserve.kernels import triton_moe  # noqa: E402
from pdserve.model.deepseek_config import MoEArch  # noqa: E402
from pdserve.model.moe import MoE  # noqa: E402

# DeepSeek-V3's (and V3.2's) experts; and tiny ones for the CPU smoke run
V3 = dict(hidden=7168, num_experts=256, top_k=8, n_group=8, topk_group=4, inter=2048)
TINY = dict(hidden=64, num_experts=8, top_k=2, n_group=2, topk_group=1, inter=32)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default=None, help="default: 1,32,128 (cuda), 1,3 (cpu)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--steps", type=int, default=20, help="timed calls per measurement")
    parser.add_argument("--sweep", action="store_true", help="time every block config too")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    on_gpu = device.type == "cuda"
    if not on_gpu and not interpreted(triton_moe._gate_up_kernel):
        sys.exit("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    dims = V3 if on_gpu else TINY
    batches = [int(b) for b in (args.batches or ("1,32,128" if on_gpu else "1,3")).split(",")]
    torch.manual_seed(0)
    ceilings = measure_ceilings(device, dtype)
    print(f"ceilings: {ceilings}", flush=True)
    layer = build(dims, device, dtype)
    rows = []
    for batch in batches:
        row = measure(
            layer, batch, device, dtype, args.steps if on_gpu else 2, ceilings["copy_GBps"]
        )
        if args.sweep:
            row.update(sweep(layer, batch, device, dtype, args.steps if on_gpu else 1))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(
            json.dumps({"dims": dims, "ceilings": ceilings, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
