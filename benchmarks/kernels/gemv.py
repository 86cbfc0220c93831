"""A batch-1 decode layer's weight products: cuBLAS (`F.linear`) vs pdserve's Triton GEMV
(kernels/triton_gemv.py), side by side in one run, beside the copy rate.

    python3 benchmarks/kernels/gemv.py --models llama3.2-1b-shape,qwen2-0.5b-shape --out g.json
    python3 benchmarks/kernels/gemv.py --sweep        # also every block config; the best per row
    TRITON_INTERPRET=1 python3 benchmarks/kernels/gemv.py --device cpu --layers 1 --replays 1 \
        --models qwen2-0.5b-shape  # a smoke run of the script, not a measurement

For each built-in model's q/k/v, o, gate-up and down shapes (one row of x), `--layers`
distinct weight copies (as a model's layers are: together larger than the L2 cache, so no
product reads its weights from L2) are multiplied in sequence inside one CUDA graph, replayed
`--replays` times; reported: µs per product, its weight bytes / that time (GB/s), and the
ratio to cuBLAS. `silu_down` is the MLP's down projection of the gate-up output: silu_mul then
cuBLAS (what runs unfused) against the one fused kernel. Each kernel's output is checked
against a float32 product first.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.roofline import measure_ceilings, time_calls  # noqa: E402
from pdserve.kernels import triton_fused, triton_gemv  # noqa: E402
from pdserve.model.builtin_specs import builtin_spec  # noqa: E402

SWEEP = ((1, 2, 4, 8), (512, 1024, 2048, 4096), (4, 8), (2, 3))  # BLOCK_N, BLOCK_K, warps, stages


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of one decoder layer's weight matrices."""
    s = builtin_spec(model)
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return {
        "qkv": (q + 2 * kv, s.hidden_size),
        "o": (s.hidden_size, q),
        "gate_up": (2 * s.intermediate_size, s.hidden_size),
        "down": (s.hidden_size, s.intermediate_size),
        "silu_down": (s.hidden_size, s.intermediate_size),  # x = gate_up's [M, 2I] output
    }


Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cublas_for(matrix: str) -> Product:
    """What the model ran before: F.linear, after the separate silu_mul kernel for silu_down."""
    if matrix == "silu_down":
        return lambda x, w: F.linear(triton_fused.silu_mul(x), w)
    return F.linear


def time_product(
    fn: Product, xs: torch.Tensor, ws: list[torch.Tensor], replays: int, device: torch.device
) -> float:
    """Seconds per product: every weight once, in sequence, in a CUDA graph (a loop on CPU)."""
    return time_calls([functools.partial(fn, xs, w) for w in ws], replays, device)


def max_rel_err(fn: Product, x: torch.Tensor, w: torch.Tensor) -> float:
    if x.shape[1] == 2 * w.shape[1]:  # silu_down
        x32 = F.silu(x[:, : w.shape[1]].float()) * x[:, w.shape[1] :].float()
    else:
        x32 = x.float()
    ref = x32 @ w.float().T
    got = fn(x, w).float()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def pdserve_with(config: triton_gemv.Config | None, silu_mul: bool = False) -> Product:
    return lambda x, w: triton_gemv.gemv(x, w, None, silu_mul, config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama3.2-1b-shape,qwen2-0.5b-shape")
    parser.add_argument("--layers", type=int, default=16, help="distinct weight copies")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sweep", action="store_true", help="time every block config too")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    ceilings = measure_ceilings(device, dtype)
    print(f"ceilings: {ceilings}", flush=True)
    rows: list[dict[str, Any]] = []
    for model in args.models.split(","):
        for name, (n, k) in layer_shapes(model).items():
            ws = [
                torch.randn(n, k, device=device, dtype=dtype) / k**0.5 for _ in range(args.layers)
            ]
            nbytes = n * k * 2
            silu = name == "silu_down"
            x = torch.randn(1, 2 * k if silu else k, device=device, dtype=dtype)
            row: dict[str, Any] = {"model": model, "matrix": name, "N": n, "K": k}
            row["err"] = max_rel_err(pdserve_with(None, silu), x, ws[0])
            cublas = time_product(cublas_for(name), x, ws, args.replays, device)
            ours = time_product(pdserve_with(None, silu), x, ws, args.replays, device)
            row.update(
                cublas_us=round(cublas * 1e6, 2),
                pdserve_us=round(ours * 1e6, 2),
                cublas_GBps=round(nbytes / cublas / 1e9),
                pdserve_GBps=round(nbytes / ours / 1e9),
                pdserve_vs_cublas=round(ours / cublas, 3),
                config=str(triton_gemv.config_for(n, k, silu)),
            )
            if args.sweep:
                row.update(sweep(x, ws, silu, args.replays, device))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"ceilings": ceilings, "rows": rows}, indent=1))


def sweep(
    x: torch.Tensor, ws: list[torch.Tensor], silu: bool, replays: int, device: torch.device
) -> dict[str, Any]:
    """The fastest block config for this product, and its time."""
    best: tuple[float, triton_gemv.Config] | None = None
    for bn, bk, warps, stages in itertools.product(*SWEEP):
        cfg = triton_gemv.Config(bn, bk, warps, stages)
        try:
            if max_rel_err(pdserve_with(cfg, silu), x, ws[0]) > 2e-2:
                continue
            t = time_product(pdserve_with(cfg, silu), x, ws, replays, device)
        except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is skipped
            print(f"  skip {cfg}: {type(exc).__name__}", flush=True)
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
    if best is None:
        return {}
    return {"best_us": round(best[0] * 1e6, 2), "best_config": str(best[1])}


if __name__ == "__main__":
    main()
