"""DeepSeek-V3 / V3.2's decode step at DeepSeek-V3's real per-layer dims, against its roofline
(issue 39 item 6; benchmarks/engine/gpu_decode.py is the dense models' twin).

    python benchmarks/engine/deepseek_decode.py --out $OUT/deepseek_decode.json     # one H100
    python benchmarks/engine/deepseek_decode.py --device cpu --scale smoke --batches 1,3 \\
        --contexts 16,48 --steps 2 --warmup 1                                 # a CPU smoke run

Models `real-v3` and `real-v32`: one dense layer and `--moe-layers` MoE ones at DeepSeek-V3's
dims, the tiny tokenizer's vocabulary (benchmarks/models/deepseek_checkpoint.py writes each
before it runs and deletes it after, unless --keep; 47 GB in bf16 with 2 MoE layers, `--fp8`
for DeepSeek's block fp8). Per model one engine (CUDA graphs on, as served; KV for
max(batches) requests of max(contexts) tokens and the decode after), then per context and
batch gpu_decode.py's measurement (`run_pdserve`): B random prompts of context + 1 tokens
prefilled, then the forward over one planned decode step (the context held fixed; median of
`--steps` after `--warmup`), the engine's tick, and the overlapped tick as served. The prompts
go through the prefix cache (gpu_decode.py's warm prefill): their first `context` tokens are
computed by requests that end at their first token, in steps of prompt chunks only
(`--prefill-tokens` a step), and the batch's own requests then start with one token each,
one step of decodes. A mixed step (decodes beside a chunk) runs MLA expanded over every
sequence in it, each context expanded to all 128 heads (about 0.5 GB a sequence at 4096
tokens): 128 requests prefilled the plain way, the later ones beside the earlier ones'
decodes, do not fit. So contexts are whole pages (16 tokens). V3.2's top-k is 2048: the
default contexts are 1024 (every key attended) and 4096 (the indexer's 2048 picks). The
graphs' index scores are as wide as the engine's page table (attention/triton_index_scores.py):
its max_model_len is max(contexts) plus the decode's room.

Roofline: max(bytes / copy bandwidth, FLOPs / matmul rate), both measured in this run
(benchmarks/kernels/roofline.py), for the measured step's own rows:
  * bytes: every weight once at its stored size (attention projections, V3.2's indexer, the
    dense MLP, the shared experts, the routers, norms, the head; the RoPE table), the embedding
    rows the batch looks up, and per MoE layer the routed experts this step activates times
    one expert's bytes: the distinct ids each layer's router picks, counted by forward hooks on
    the routers during one eager run of the same step (graphs off for it; it rewrites the same
    KV slots);
    plus per layer and row the KV the step must read and write: its latent (kv_lora + rope
    values) for every context token, V3.2 only for its min(context, index_topk) picks, V3.2's
    index-K (and its scale with `--index-k-dtype fp8`) for every context token (the indexer
    scores them all), and one token of each written;
  * FLOPs: 2 per weight a token uses (its top_k experts) per token, plus absorbed attention's
    2 * heads * (2 kv_lora + rope) and the indexer's 2 * index_heads * index_head_dim per
    context row it reads, per layer.
`forward / roofline` is the model's step; `step / roofline` the overlapped tick, as served.
`--split` (default on CUDA) profiles the batch-1 forward and groups its kernels: the fused
routed experts, V3.2's index scores, latent attention, and gpu_kernels.py's groups (the
projections' and the dense and shared MLPs' GEMMs, elementwise, copies).
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
import time
from collections import defaultdict
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.gpu_decode import (  # noqa: E402
    PAGE_SIZE,
    Report,
    decode_engine,
    max_new_tokens,
    run_pdserve,
)
from benchmarks.kernels.gpu_kernels import GROUPS, kernel_table  # noqa: E402
from benchmarks.kernels.roofline import measure_ceilings, roofline  # noqa: E402
from benchmarks.models import deepseek_checkpoint as checkpoint  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.runner import ModelRunner  # noqa: E402
from pdserve.engine.scheduler import Chunk  # noqa: E402
from pdserve.kvcache.layout import LATENT  # noqa: E402
from pdserve.model.moe import MoE  # noqa: E402
from pdserve.runtime.gc_freeze import freeze_startup_heap  # noqa: E402

# The kernels of a DeepSeek decode step, first match wins, then gpu_kernels.py's groups.
SPLIT_GROUPS = (
    ("routed experts", r"_gate_up_kernel|_down_kernel|_sum_kernel"),
    ("index scores", r"_index_scores_kernel"),
    ("latent attention", r"_latent_decode_kernel"),
    *GROUPS,
)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


# ---------------------------------------------------------------- what a step must move


def routed_experts(runner: ModelRunner, chunks: list[Chunk]) -> dict[int, int]:
    """{MoE layer: the distinct experts its router picks in this step}, from hooks
    on the routers during one eager forward of it (graphs off: hooks do not run in a replay)."""
    picked: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(runner.model.model.layers):
        if isinstance(layer.mlp, MoE):

            def hook(_m: Any, _inp: Any, out: Any, i: int = i) -> None:
                picked[i] = out[1]  # (weights, ids [N, top_k])

            hooks.append(layer.mlp.gate.register_forward_hook(hook))
    graphs, runner.graphs = runner.graphs, None
    try:
        runner.forward(chunks)
    finally:
        runner.graphs = graphs
        for h in hooks:
            h.remove()
    return {i: int(picked[i].unique().numel()) for i in sorted(picked)}


def step_cost(
    engine: Engine, chunks: list[Chunk], active: dict[int, int]
) -> tuple[dict[str, int], int]:
    """(bytes by part, FLOPs) of one decode step over `chunks` whose MoE layer i activates
    `active[i]` distinct experts (module docstring)."""
    model, arch = engine.model, engine.model.arch
    assert arch.moe is not None and arch.mla is not None
    batch, e = len(chunks), arch.moe.num_experts
    parts: dict[str, int] = defaultdict(int)
    matmul_weights = 0  # per token
    for name, t in chain(model.named_parameters(), model.named_buffers()):
        nbytes = t.numel() * t.element_size()
        if name == "model.embed_tokens.weight" and not arch.tie_word_embeddings:
            parts["head, norms, embedding rows"] += batch * t.shape[1] * t.element_size()
            continue
        if ".mlp.experts." in name:
            layer = int(_LAYER.match(name).group(1))  # type: ignore[union-attr]
            parts["routed experts"] += nbytes * active[layer] // e
            matmul_weights += t.numel() * arch.moe.top_k // e if t.dim() == 3 else 0
            continue
        part = (
            "attention"
            if ".self_attn." in name
            else "MLPs, shared experts, routers"
            if ".mlp." in name
            else "head, norms, embedding rows"
        )
        parts[part] += nbytes
        matmul_weights += t.numel() if t.dim() == 2 else 0
    m, dsa = arch.mla, arch.dsa
    ctxs = [c.request.num_tokens for c in chunks]  # the rows each decode attends (itself too)
    attended = [min(n, dsa.index_topk) if dsa is not None else n for n in ctxs]
    for region in engine.pool.layout.regions:  # one per (layer, buffer)
        rows = attended if region.spec.name == LATENT else ctxs
        part = "latent" if region.spec.name == LATENT else "index-K"
        parts[part] += sum(n + 1 for n in rows) * region.spec.token_bytes  # read, 1 written
    attn = 2 * arch.num_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim) * sum(attended)
    if dsa is not None:
        attn += 2 * dsa.index_n_heads * dsa.index_head_dim * sum(ctxs)
    return dict(parts), 2 * batch * matmul_weights + arch.num_layers * attn


def split(runner: ModelRunner, chunks: list[Chunk], device: torch.device, steps: int) -> Any:
    """The batch's forward under torch.profiler, its kernels' ms per step by SPLIT_GROUPS."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.forward(chunks)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    groups: dict[str, float] = defaultdict(float)
    for k in kernel_table(prof, steps, device.type == "cuda"):
        group = next((g for g, p in SPLIT_GROUPS if re.search(p, k["name"])), "other")
        groups[group] += k["ms"]
    return {g: round(ms, 4) for g, ms in sorted(groups.items(), key=lambda kv: -kv[1])}


# ---------------------------------------------------------------- the run


def bench_model(
    name: str, args: argparse.Namespace, ceilings: dict[str, float], report: Report
) -> None:
    device = torch.device(args.device)
    spec = checkpoint.spec_of(name, args)
    with checkpoint.generated(spec, checkpoint.write_device(args), args.root, args.keep) as w:
        print(checkpoint.describe(spec, w), flush=True)
        report.meta.setdefault("checkpoints", {})[name] = checkpoint.describe(spec, w)
        t0 = time.perf_counter()
        longest = argparse.Namespace(**{**vars(args), "ctx": max(args.contexts) + 1})
        max_len = longest.ctx + max_new_tokens(max(args.batches), longest) + 64
        engine = decode_engine(
            w.path, args, max_len, prefill_tokens=args.prefill_tokens,
            index_k_dtype=args.index_k_dtype,
        )  # fmt: skip
        report.meta.setdefault("engine_build_s", {})[name] = round(time.perf_counter() - t0, 1)
        freeze_startup_heap()  # as a server does before it serves (pdserve/runtime/gc_freeze.py)
        try:
            for ctx in args.contexts:
                for batch in args.batches:
                    at = argparse.Namespace(**{**vars(args), "ctx": ctx + 1})  # module doc
                    row = measure(engine, batch, at, ceilings)
                    fields = {"name": spec.name, "context": ctx, **row}
                    report.add(f"{spec.name} ctx {ctx}", batch, fields)
        finally:
            gc.unfreeze()  # this process goes on (the next model): its garbage is collectable
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()


def measure(
    engine: Engine, batch: int, args: argparse.Namespace, ceilings: dict[str, float]
) -> dict[str, Any]:
    runner = engine.runner
    device = engine.pool.device
    t0 = time.perf_counter()

    def probe(chunks: list[Chunk]) -> dict[str, Any]:
        active = routed_experts(runner, chunks)
        parts, flops = step_cost(engine, chunks, active)
        out: dict[str, Any] = {"distinct_experts": list(active.values()), "bytes_by_part": parts}
        out.update(roofline((sum(parts.values()), flops), ceilings))
        if args.split and batch == 1:
            out["split_ms"] = split(runner, chunks, device, args.steps)
        return out

    graphs = runner.graphs
    before = graphs.replays if graphs is not None else 0
    row = run_pdserve(engine, runner, batch, args, probe)
    row["graphs"] = graphs is not None and graphs.replays > before
    row["measure_s"] = round(time.perf_counter() - t0, 1)
    row["forward_over_roofline"] = round(row["forward_ms"] / row["roofline_ms"], 2)
    row["step_over_roofline"] = round(row["overlap_step_ms"] / row["roofline_ms"], 2)
    return row


def markdown(report: Report) -> str:
    def num(v: float) -> str:
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"

    lines = [
        "| model | batch | context | forward ms | engine step ms | overlapped step ms "
        "| roofline ms | forward / roofline | step / roofline | distinct experts per MoE "
        "layer | GB per step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    rows = report.ordered()
    for r in rows:
        cells = [
            r["name"], str(r["batch"]), num(r["ctx"]), num(r["forward_ms"]),
            num(r["engine_step_ms"]), num(r["overlap_step_ms"]), num(r["roofline_ms"]),
            num(r["forward_over_roofline"]), num(r["step_over_roofline"]),
            ", ".join(map(str, r["distinct_experts"])), f"{r['bytes_per_step'] / 1e9:.3g}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    parts = sorted({p for r in rows for p in r["bytes_by_part"]})
    lines += ["", "Roofline bytes per step (GB):", ""]
    lines.append("| model | batch | context | " + " | ".join(parts) + " |")
    lines.append("|---|---:|---:|" + "---:|" * len(parts))
    for r in rows:
        got = [f"{r['bytes_by_part'].get(p, 0) / 1e9:.3g}" for p in parts]
        lines.append(f"| {r['name']} | {r['batch']} | {num(r['ctx'])} | " + " | ".join(got) + " |")
    split_rows = [r for r in rows if "split_ms" in r]
    if split_rows:
        groups = sorted({g for r in split_rows for g in r["split_ms"]})
        lines += ["", "Batch-1 forward, kernel ms per step by group (torch.profiler):", ""]
        lines.append("| model | context | forward ms | " + " | ".join(groups) + " |")
        lines.append("|---|---:|---:|" + "---:|" * len(groups))
        for r in split_rows:
            got = [num(r["split_ms"].get(g, 0.0)) for g in groups]
            lines.append(
                f"| {r['name']} | {num(r['ctx'])} | {num(r['forward_ms'])} | "
                + " | ".join(got)
                + " |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x]

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="real-v3,real-v32")
    ap.add_argument("--batches", type=ints, default=[1, 32, 128])
    ap.add_argument("--contexts", type=ints, default=[1024, 4096], help="prompt tokens")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per measurement")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--prefill-tokens", type=int, default=2048,
        help="the step budget prefilling (the expanded prefill's scores grow with it)",
    )  # fmt: skip
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--backend", default=None, help="attention backend (default: the device's)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (--enforce-eager)")
    ap.add_argument("--index-k-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument(
        "--split", action=argparse.BooleanOptionalAction, default=None,
        help="profile the batch-1 forward by kernel group (default: on CUDA)",
    )  # fmt: skip
    ap.add_argument("--out", default=None, help="JSON file, rewritten after every row")
    checkpoint.add_arguments(ap)
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    if any(m not in ("real-v3", "real-v32") for m in args.models):
        ap.error(f"--models are real-v3 and real-v32, got {args.models}")
    if min(args.batches + args.contexts) < 1 or args.steps < 1 or args.prefill_tokens < 1:
        ap.error("batches, contexts, --steps and --prefill-tokens must be positive")
    if any(c % PAGE_SIZE for c in args.contexts):
        ap.error(f"contexts must be whole pages of {PAGE_SIZE} tokens (the warm prefill's)")
    args.warm_prefill = True  # module docstring
    if args.split is None:
        args.split = args.device == "cuda"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    meta: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    meta["torch"] = torch.__version__
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    meta["ceilings"] = ceilings = measure_ceilings(device, getattr(torch, args.dtype))
    print(f"ceilings: {ceilings}", file=sys.stderr, flush=True)
    report = Report(args.out, meta)
    for name in args.models:
        bench_model(name, args, ceilings, report)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
