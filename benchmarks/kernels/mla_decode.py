"""DeepSeek-V3's latent attention in a decode step: the absorbed form's Triton kernel against
the expanded gather path, beside the kernel's roofline.

    python benchmarks/kernels/mla_decode.py --out mla.json [--iters 30] [--sweep]
    python benchmarks/kernels/mla_decode.py --device cpu --out /tmp/mla.json  # a smoke run

One MLA layer at DeepSeek-V3's dimensions (128 heads, kv_lora 512, rope 64, nope 128, v 128,
hidden 7168, q_lora 1536; random weights, bfloat16) over a latent pool of two layers with
shuffled pages of 16 (a layer's view strided across pages, as in serving); a step of decodes,
batch 1, 32 and 128, every row at a context of 1,024 or 4,096. Reported per case, GPU time
between CUDA events with L2 flushed before each call (the median over --iters), eagerly:
  * expanded_ms: the layer's forward on the `torch` backend (gather the context, kv_b_proj over
    every cached latent, softmax attention), as the CPU's backend and every prefill run it;
    skipped where its intermediates would not fit in memory (the reason is recorded);
  * absorbed_ms: the same forward on the `triton` backend (its decode step absorbed);
  * kernel_ms: the absorbed kernel alone (attention/triton_mla_decode.py, the backend's split
    count, its reduce included), its latent bytes read (every row's context x 576 x 2 B) over
    kernel_ms in GB/s, and roofline_ms: those bytes over the device-to-device copy rate
    measured in the same run (benchmarks/kernels/roofline.py measure_ceilings);
  * diffs: max |absorbed - expanded| of the layer's output over its max |expanded| (bfloat16
    rounding: ~1e-2), and max |kernel - torch reference| (attention/mla_backend.py
    latent_decode_torch). A case over TOLERANCE fails the run (exit 1).
--sweep also times the kernel alone per (block_h, block_n, num_warps, num_stages).
--device cpu runs tiny shapes through the same code in Triton's interpreter: a check of this
script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
ARGV = sys.argv[1:]
ON_CPU = not torch.cuda.is_available() or "--device=cpu" in ARGV
ON_CPU |= any(a == "--device" and b == "cpu" for a, b in zip(ARGV, ARGV[1:], strict=False))
if ON_CPU:  # before anything imports triton: on the CPU the kernels run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from benchmarks.kernels.roofline import measure_ceilings  # noqa: E402
from pdserve.attention.backend import AttentionContext  # noqa: E402
from pdserve.attention.batch import Batch, BatchBuilder, SeqSpan  # noqa: E402
from pdserve.attention.mla_backend import LatentDecode, MLABackend, latent_decode_torch  # noqa: E402
from pdserve.attention.torch_backend import TorchBackend  # noqa: E402
from pdserve.attention.triton_decode import partial_shapes  # noqa: E402
from pdserve.attention.triton_mla_decode import paged_latent_decode  # noqa: E402
from pdserve.kvcache.layout import LATENT, KVLayout  # noqa: E402
from pdserve.kvcache.pool import KVPool  # noqa: E402
from pdserve.model.config import ModelArch  # noqa: E402
from pdserve.model.deepseek_config import MLAArch  # noqa: E402
from pdserve.model.mla import MLAttention, rope_tables  # noqa: E402
from pdserve.model.mla_absorbed import absorb_query, kv_b_halves  # noqa: E402

V3_CONFIG: dict[str, Any] = {  # DeepSeek-V3's config.json, two layers
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "num_hidden_layers": 2, "num_attention_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "moe_intermediate_size": 2048,
    "n_shared_experts": 1, "first_k_dense_replace": 3, "max_position_embeddings": 163840,
    "rope_theta": 10000, "torch_dtype": "bfloat16",
    "rope_scaling": {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    },
}  # fmt: skip
TINY = {  # --device cpu: deepseek-v3-tiny's attention
    "hidden_size": 128, "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
    "qk_nope_head_dim": 24, "qk_rope_head_dim": 16, "v_head_dim": 20,
}  # fmt: skip
CASES = [(b, ctx) for ctx in (1024, 4096) for b in (1, 32, 128)]
SMOKE_CASES = [(1, 37), (3, 40)]
SWEEP = [(h, n, w, s) for h in (16, 32, 64) for n in (16, 32, 64) for w in (4, 8) for s in (1, 2)]
SMOKE_SWEEP = [(16, 16, 4, 1)]
PAGE_SIZE, LAYER = 16, 1
TOLERANCE = 3e-2
FLUSH_BYTES = 256 << 20  # more than an H200's L2
MEMORY_SHARE = 0.6  # the expanded path is skipped where its intermediates need more than this


class Timer:
    """GPU time of a call with a cold L2 (a large buffer written before each call); on the
    CPU, host time."""

    def __init__(self, device: torch.device, iters: int) -> None:
        self.device, self.iters = device, iters
        on_gpu = device.type == "cuda"
        self.flush = torch.empty(FLUSH_BYTES if on_gpu else 1, dtype=torch.uint8, device=device)

    def ms(self, fn: Callable[[], object]) -> float:
        fn()  # compiles
        times = []
        for _ in range(self.iters):
            self.flush.zero_()
            if self.device.type != "cuda":
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


def expanded_bytes(batch: int, ctx: int, heads: int, m: MLAArch) -> int:
    """The expanded path's largest intermediates at once: the gathered latents, every cached
    latent's keys and values, the concatenated keys (bfloat16), three float32 score tensors."""
    kv = batch * ctx * heads * (m.qk_nope_head_dim + m.v_head_dim)
    keys = batch * ctx * heads * m.qk_head_dim
    return 2 * (batch * ctx * m.latent_dim + kv + keys) + 3 * 4 * batch * heads * ctx


class Step:
    """A decode step of `batch` rows at context `ctx` over a pool of shuffled pages, and the
    layer's inputs for it."""

    def __init__(self, bench: Bench, batch: int, ctx: int) -> None:
        m, dev, gen = bench.m, bench.device, bench.gen
        need = -(-ctx // PAGE_SIZE)
        num_pages = batch * need + 1  # page 0: the page table's padding
        dtype = str(bench.dtype).removeprefix("torch.")
        layout = KVLayout.mla(dtype, PAGE_SIZE, 2, m.kv_lora_rank, m.qk_rope_head_dim)
        self.pool = KVPool(layout, num_pages, dev)
        for i in range(2):
            view = self.pool.view(i, LATENT)
            view.copy_(torch.randn(view.shape, generator=gen, device=dev))
        free = (torch.randperm(num_pages - 1) + 1).tolist()
        spans = [
            SeqSpan([1], ctx - 1, [free.pop() for _ in range(need)], True) for _ in range(batch)
        ]
        self.batch: Batch = BatchBuilder(PAGE_SIZE, num_pages, dev).build(spans)
        hidden = bench.arch.hidden_size
        self.x = torch.randn(batch, hidden, generator=gen, device=dev).to(bench.dtype)
        freqs = self.batch.positions.float()[:, None] * bench.inv_freq[None, :]
        self.cos = (freqs.cos() * bench.rope_factor).to(bench.dtype)[:, None, :]
        self.sin = (freqs.sin() * bench.rope_factor).to(bench.dtype)[:, None, :]

    def forward(self, layer: MLAttention, ctx: AttentionContext[Any]) -> Callable[[], torch.Tensor]:
        return lambda: layer(self.x, self.cos, self.sin, ctx)


class Launch:
    """The kernel alone with given launch settings, at the backend's split count."""

    def __init__(
        self, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
        decode: LatentDecode, scale: float,
    ) -> None:  # fmt: skip
        self.args = (q_latent, q_rope, cache, decode.page_table, decode.kv_lens)
        self.out = torch.empty_like(q_latent)
        self.scale, self.splits = scale, decode.num_splits
        rows, heads, rank = q_latent.shape
        out_shape, lse_shape = partial_shapes(rows, heads, self.splits, rank)
        split = self.splits > 1
        self.part_out = torch.empty(out_shape, device=q_latent.device) if split else None
        self.part_lse = torch.empty(lse_shape, device=q_latent.device) if split else None

    def time(self, timer: Timer, block_h: int, block_n: int, warps: int, stages: int) -> dict:
        """The kernel's time with these settings (or why they do not compile)."""
        row: dict[str, Any] = dict(block_h=block_h, block_n=block_n, warps=warps, stages=stages)

        def call() -> None:
            paged_latent_decode(
                *self.args, self.out, self.scale, self.splits, self.part_out, self.part_lse,
                block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages,
            )  # fmt: skip

        try:
            row["kernel_ms"] = timer.ms(call)
        except OutOfResources as e:  # too large a tile for the SM's shared memory or registers
            row["error"] = str(e)
        return row


class Bench:
    """One MLA layer (nn.Linear's own initialisation, on the device) and the run's ceilings."""

    def __init__(self, device: torch.device, iters: int) -> None:
        tiny = device.type == "cpu"
        self.device = device
        self.dtype = torch.float32 if tiny else torch.bfloat16
        self.arch = ModelArch.from_hf_config({**V3_CONFIG, **(TINY if tiny else {})})
        assert self.arch.mla is not None
        self.m: MLAArch = self.arch.mla
        self.gen = torch.Generator(device=device).manual_seed(0)
        torch.manual_seed(0)
        with torch.device(device):
            self.layer = MLAttention(self.arch, LAYER).to(self.dtype)
        inv_freq, self.rope_factor = rope_tables(
            self.m.qk_rope_head_dim, self.arch.rope_theta, self.arch.rope_scaling
        )
        self.inv_freq = inv_freq.to(device)
        self.timer = Timer(device, iters)
        self.ceilings = measure_ceilings(device, self.dtype)
        self.free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 1 << 40

    def case(self, batch: int, ctx: int, sweep: list[tuple[int, int, int, int]]) -> dict:
        m, arch, layer, timer = self.m, self.arch, self.layer, self.timer
        s = Step(self, batch, ctx)
        absorbed_b = MLABackend(s.pool, arch)
        a_meta = absorbed_b.prepare(s.batch)
        decode = a_meta.decode
        assert decode is not None
        absorbed = s.forward(layer, AttentionContext(absorbed_b, a_meta))
        row: dict[str, Any] = {"batch": batch, "context": ctx, "num_splits": decode.num_splits}
        absorbed_out = absorbed().float()
        row["absorbed_ms"] = timer.ms(absorbed)
        need = expanded_bytes(batch, ctx, arch.num_heads, m)
        if need > MEMORY_SHARE * self.free:
            row["expanded_skipped"] = (
                f"its intermediates need {need / 2**30:.0f} GiB of {self.free / 2**30:.0f} free"
            )
        else:
            expanded_b = TorchBackend(s.pool, arch)
            expanded = s.forward(layer, AttentionContext(expanded_b, expanded_b.prepare(s.batch)))
            try:
                want = expanded().float()
                diff = (absorbed_out - want).abs().max() / want.abs().max()
                row["rel_diff_vs_expanded"] = diff.item()
                row["expanded_ms"] = timer.ms(expanded)
                row["speedup"] = row["expanded_ms"] / row["absorbed_ms"]
                del want
            except torch.cuda.OutOfMemoryError as e:  # the estimate above was short
                row["expanded_skipped"] = f"out of memory: {str(e).splitlines()[0]}"
                torch.cuda.empty_cache()
        # The kernel alone, on an absorbed query.
        q = torch.randn(batch, arch.num_heads, m.qk_head_dim, generator=self.gen, device=s.x.device)
        q_nope, q_rope = q.to(self.dtype).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        q_latent = absorb_query(q_nope, kv_b_halves(layer.kv_b_proj.weight, arch.num_heads, m)[0])
        cache = s.pool.view(LAYER, LATENT)
        ref = latent_decode_torch(
            q_latent, q_rope, cache, decode.page_table, decode.kv_lens, m.softmax_scale
        )

        def kernel() -> torch.Tensor:
            return absorbed_b.attend_latent(LAYER, q_latent, q_rope, m.softmax_scale, a_meta)

        diff = (kernel().float() - ref.float()).abs().max()
        row["kernel_max_abs_diff_vs_reference"] = diff.item()
        latent_bytes = batch * ctx * m.latent_dim * cache.element_size()
        row["latent_bytes"] = latent_bytes
        row["kernel_ms"] = timer.ms(kernel)
        row["kernel_GBps"] = latent_bytes / row["kernel_ms"] / 1e6
        row["roofline_ms"] = latent_bytes / self.ceilings["copy_GBps"] / 1e6
        row["kernel_of_roofline"] = row["roofline_ms"] / row["kernel_ms"]
        if sweep:
            launch = Launch(q_latent, q_rope, cache, decode, m.softmax_scale)
            row["sweep"] = [launch.time(timer, *x) for x in sweep]
        return row


def best_swept(sweep: list[dict]) -> str:
    timed = [x for x in sweep if "kernel_ms" in x]
    if not timed:
        return "none compiled"
    b = min(timed, key=lambda x: x["kernel_ms"])
    return f"{b['kernel_ms']:.3f} ms ({b['block_h']}, {b['block_n']}, {b['warps']}, {b['stages']})"


def report(r: dict) -> str:
    expanded = f"expanded {r['expanded_ms']:.3f} ms" if "expanded_ms" in r else "expanded skipped"
    return (
        f"b={r['batch']:<3} ctx={r['context']:<4} splits={r['num_splits']:<2} {expanded}  "
        f"absorbed {r['absorbed_ms']:.3f} ms"
        + (f" ({r['speedup']:.1f}x)" if "speedup" in r else "")
        + f"  kernel {r['kernel_ms']:.3f} ms ({r['kernel_GBps']:.0f} GB/s, roofline "
        f"{r['roofline_ms']:.3f} ms: {r['kernel_of_roofline']:.0%})"
        + (f"  best swept {best_swept(r['sweep'])}" if "sweep" in r else "")
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="where the JSON results go")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--sweep", action="store_true", help="also each kernel launch setting")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("mla_decode: needs a CUDA GPU (--device cpu: a smoke run)")
        return 2
    tiny = device.type == "cpu"
    bench = Bench(device, min(args.iters, 2) if tiny else args.iters)
    print(f"device-to-device copy: {bench.ceilings['copy_GBps']:.0f} GB/s (read + write)")
    sweep = (SMOKE_SWEEP if tiny else SWEEP) if args.sweep else []
    rows = []
    with torch.inference_mode():
        for batch, ctx in SMOKE_CASES if tiny else CASES:
            rows.append(bench.case(batch, ctx, sweep))
            print(report(rows[-1]))
    diffs = [r.get("rel_diff_vs_expanded", 0.0) for r in rows]
    diffs += [r["kernel_max_abs_diff_vs_reference"] for r in rows]
    ok = all(d <= TOLERANCE for d in diffs)
    m = bench.m
    result = {
        "env": {
            "gpu": torch.cuda.get_device_name(device) if not tiny else "none (interpreter)",
            "torch": torch.__version__,
            "triton": triton.__version__,
        },
        "shape": {
            "heads": bench.arch.num_heads,
            "kv_lora_rank": m.kv_lora_rank,
            "rope": m.qk_rope_head_dim,
            "nope": m.qk_nope_head_dim,
            "v": m.v_head_dim,
            "dtype": str(bench.dtype),
            "page_size": PAGE_SIZE,
        },  # fmt: skip
        "ceilings": bench.ceilings,
        "cases": rows,
        "ok": ok,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{'OK' if ok else 'FAILED'}: results in {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
