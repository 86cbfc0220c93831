"""Why DeepSeek's prompt chunks attend in the expanded form and its decodes absorbed (issue 39
item 1): one sequence's prompt chunk of T tokens through latent attention both ways, at
DeepSeek-V3's dimensions, on the best attention torch has for each shape.

    python benchmarks/kernels/mla_prefill.py --out mla_prefill.json
    python benchmarks/kernels/mla_prefill.py --device cpu --tokens 64 --heads 4   # a smoke run

From the chunk's latent (c_kv [T, 512], k_rope [T, 64]) and queries (q_nope [T, H, 128],
q_rope [T, H, 64]), causal over the chunk, bfloat16, random weights:
  * expanded (model/mla.py, what prompt chunks run): kv_b_proj over every latent row gives each
    head's k_nope and v ([T, H, 128] each), then scaled-dot-product attention per head at head
    dims 192 / 128;
  * absorbed (model/mla_absorbed.py, what decodes run): W_UK folded into the queries
    ([T, H, 512]), attention over the shared latent rows at head dims 576 / 512 (one K/V row for
    every head), W_UV applied to the result.
Each is timed between CUDA events after a warm-up (the median of --iters), and its FLOPs counted
(attention 2·T²/2·H·(d_qk + d_v), the projections 2·T·H·...); the outputs are compared (max
relative difference: the two forms are one computation). Expanded attention pads v to 192 so
that it runs FlashAttention (head dim ≤ 256); absorbed attention's head dim 576 has no flash
kernel in torch, and its FLOPs per token pair are 3.4× expanded's: the prompt chunks stay
expanded, where attention is compute-bound, and decodes, bound by reading the cache, read the
576-byte latent row once for every head instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

NOPE, ROPE, V, LORA = 128, 64, 128, 512


def timed(fn: Callable[[], torch.Tensor], iters: int, device: torch.device) -> float:
    """Median ms per call."""
    for _ in range(2):
        fn()
    if device.type != "cuda":
        import time

        out = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
        return statistics.median(out)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def case(t: int, h: int, device: torch.device, dtype: torch.dtype, iters: int) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(t)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)

    c_kv, k_rope = rand(t, LORA), rand(t, ROPE)
    q_nope, q_rope = rand(t, h, NOPE), rand(t, h, ROPE)
    w_kv_b = rand(h * (NOPE + V), LORA, scale=LORA**-0.5)  # kv_b_proj.weight
    w_uk = w_kv_b.view(h, NOPE + V, LORA)[:, :NOPE]  # [H, 128, 512]
    w_uv = w_kv_b.view(h, NOPE + V, LORA)[:, NOPE:]  # [H, 128, 512]
    scale = (NOPE + ROPE) ** -0.5

    def expanded() -> torch.Tensor:
        kv = F.linear(c_kv, w_kv_b).view(t, h, NOPE + V)
        k = torch.cat([kv[..., :NOPE], k_rope[:, None].expand(t, h, ROPE)], -1)
        q = torch.cat([q_nope, q_rope], -1)
        # v padded to q's 192 so that FlashAttention takes it (as vLLM's MLA prefill does)
        v = F.pad(kv[..., NOPE:], (0, NOPE + ROPE - V))
        out = F.scaled_dot_product_attention(  # [1, H, T, 192]: batch, heads, tokens, dim
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale,
        )  # fmt: skip
        return out[0].transpose(0, 1)[..., :V]  # [T, H, 128]

    def absorbed() -> torch.Tensor:
        q_lat = torch.einsum("thn,hnl->thl", q_nope, w_uk)  # [T, H, 512]
        q = torch.cat([q_lat, q_rope], -1).transpose(0, 1)  # [H, T, 576]
        k = torch.cat([c_kv, k_rope], -1)[None].expand(h, t, LORA + ROPE)
        v = c_kv[None].expand(h, t, LORA)
        lat = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)
        return torch.einsum("htl,hvl->thv", lat[0], w_uv)  # [T, H, 128]

    pairs = t * (t + 1) / 2 * h
    flops = {
        "expanded": 2 * pairs * ((NOPE + ROPE) + V) + 2 * t * LORA * h * (NOPE + V),
        "absorbed": 2 * pairs * ((LORA + ROPE) + LORA) + 2 * t * h * NOPE * LORA * 2,
    }
    want, got = expanded().float(), absorbed().float()
    row: dict[str, Any] = {"tokens": t, "heads": h}
    for name, fn in (("expanded", expanded), ("absorbed", absorbed)):
        ms = timed(fn, iters, device)
        row[f"{name}_ms"] = round(ms, 3)
        row[f"{name}_gflop"] = round(flops[name] / 1e9, 1)
        row[f"{name}_tflops"] = round(flops[name] / ms / 1e9, 1)
    row["absorbed_over_expanded"] = round(row["absorbed_ms"] / row["expanded_ms"], 2)
    row["max_rel_diff"] = float((got - want).abs().max() / want.abs().max())
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", default="512,2048,4096", help="prompt chunk sizes")
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    with torch.inference_mode():
        for t in (int(x) for x in args.tokens.split(",")):
            rows.append(case(t, args.heads, device, dtype, args.iters))
            print(json.dumps(rows[-1]), flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(rows, indent=1))
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"\n{gpu}, {dtype}\n| T | expanded ms | absorbed ms | absorbed / expanded | "
          "expanded TFLOP/s | absorbed TFLOP/s | max rel diff |\n" + "|---:" * 7 + "|")  # fmt: skip
    for r in rows:
        print(f"| {r['tokens']} | {r['expanded_ms']} | {r['absorbed_ms']} | "
              f"{r['absorbed_over_expanded']} | {r['expanded_tflops']} | {r['absorbed_tflops']} "
              f"| {r['max_rel_diff']:.2e} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
