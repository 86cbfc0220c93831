"""Decode step time on one GPU: pdserve's engine pieces beside the roofline and HF, same run.

    python benchmarks/engine/gpu_decode.py --out $OUT/gpu_decode.json            # the H200 run
    python benchmarks/engine/gpu_decode.py --device cpu --models tiny --batches 1,4 --ctx 40 \\
        --steps 3 --warmup 1                                                # a CPU smoke run

For each model and batch, B requests with `--ctx`-token prompts are prefilled through the
engine; then, with every request decoding at context ~ctx, three numbers per step:
  * forward: `ModelRunner.forward` over the B decode chunks (batch build, its one upload, the
    model, the logits), the context held fixed, timed step by step with CUDA events after a
    warm-up (the median is reported);
  * engine step: `Engine.tick()` (schedule, forward, sample, emit), context growing by one a
    step, measured twice on the same requests: the plain loop, then overlapped scheduling
    (engine/inflight.py: the CPU prepares step N+1 while the GPU runs step N), the period
    between steps' ends on the stream (and the overlapped wall clock per tick beside it);
  * roofline: max(bytes / copy bandwidth, FLOPs / matmul rate), both ceilings measured in this
    run: bytes = the weights (a tied head once) + the KV read and written; FLOPs = 2 per
    weight per token (the head included) + 4 * ctx * heads * head_dim per layer per token.
HF transformers decodes the same model directory (same weights) at `--hf-batches` with a static
cache and torch.compile, as `generate` documents it (benchmarks/engine/hf_decode.py says how).

Built-in models are generated on first use (about 25 s for llama3.2-1b-shape on one core;
`model_build_s` in the JSON). Every finished row is written to --out at once, so a run cut
short by a time limit still leaves what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.decode_batch import (  # noqa: E402
    check_none_ended,
    decode_chunks,
    prefill,
)
from benchmarks.engine.hf_decode import hf_decode_steps  # noqa: E402
from benchmarks.kernels.roofline import measure_ceilings, roofline, step_cost, sync, time_steps  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.offline import build_engine  # noqa: E402
from pdserve.engine.runner import ModelRunner  # noqa: E402
from pdserve.engine.scheduler import Chunk  # noqa: E402
from pdserve.kvcache.layout import KVLayout  # noqa: E402
from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.model.config import ModelArch  # noqa: E402
from pdserve.runtime.gc_freeze import freeze_startup_heap  # noqa: E402

PAGE_SIZE = 16
PREFILL_TOKENS = 8192  # the step budget while prefilling: a batch of 256 prompts in ~10 steps
Probe = Callable[[list[Chunk]], dict[str, Any]]  # run on the measured step's chunks: more fields


# ---------------------------------------------------------------- pdserve


def max_new_tokens(batch: int, args: argparse.Namespace) -> int:
    """What each request may generate, so that none ends inside the measurement: the measured
    steps (`run_pdserve` decodes 3 * steps + 2 * warmup tokens) with room to spare, plus one a
    step while the batch prefills (a request decodes while the later ones prefill)."""
    prefill_steps = -(-batch * args.ctx // max(args.prefill_tokens - batch, 1))
    return 4 * (args.warmup + args.steps) + 8 + prefill_steps


def run_pdserve(
    engine: Engine,
    runner: ModelRunner,
    batch: int,
    args: argparse.Namespace,
    probe: Probe | None = None,
) -> dict[str, Any]:
    """One row: the forward, the engine step and the overlapped step at `batch`; `probe`, if
    given, runs once on the measured step's chunks (after the forward's timing, before the
    ticks') and its fields join the row."""
    device = engine.pool.device
    overlap_default = engine.overlap
    t0 = time.perf_counter()
    ended: dict[str, str] = {}
    ids = prefill(engine, batch, args.ctx, max_new_tokens(batch, args), ended, args.warm_prefill)
    engine.sync()  # no step in flight: the planned decode below has every input on the host
    sync(device)
    prefill_s = time.perf_counter() - t0
    check_none_ended(ended)
    # Run again and again, the same step rewrites the same KV slots: the context stays fixed.
    chunks = decode_chunks(engine, ids)
    reqs = [c.request for c in chunks]
    ctx = sum(r.num_tokens for r in reqs) / batch
    fwd = time_steps(lambda: runner.forward(chunks), device, args.warmup, args.steps)
    wall0 = time.perf_counter()
    for _ in range(args.steps):
        runner.forward(chunks)
    sync(device)
    fwd_wall = (time.perf_counter() - wall0) / args.steps
    probed = probe(chunks) if probe is not None else {}
    before = [len(r.output_ids) for r in reqs]
    graphs = runner.graphs
    replays = lambda: graphs.replays if graphs is not None else 0  # noqa: E731
    engine.overlap = False
    r0 = replays()
    tick = time_steps(engine.tick, device, args.warmup, args.steps)
    r1 = replays()
    engine.overlap = True  # overlapped scheduling (engine/inflight.py), same requests
    overlapped = time_steps(engine.tick, device, args.warmup, args.steps)
    r2 = replays()
    wall0 = time.perf_counter()
    for _ in range(args.steps):
        engine.tick()
    sync(device)
    overlap_wall = (time.perf_counter() - wall0) / args.steps
    engine.sync()
    engine.overlap = overlap_default
    check_none_ended(ended)
    if [len(r.output_ids) - n for r, n in zip(reqs, before, strict=True)] != [
        3 * args.steps + 2 * args.warmup
    ] * batch:
        raise RuntimeError("an engine tick did not decode every request once")
    for rid in ids:
        engine.abort(rid)
    engine.tick()  # handles the aborts: every page goes back
    if engine.pool.allocator.num_held:  # the prefix cache may keep pages: those are evictable
        raise RuntimeError(f"{engine.pool.allocator.num_held} pages still held after the aborts")
    fwd_ms, tick_ms = statistics.median(fwd) * 1e3, statistics.median(tick) * 1e3
    overlap_ms = statistics.median(overlapped) * 1e3
    return {
        "ctx": round(ctx, 1),
        "prefill_s": round(prefill_s, 3),
        "forward_ms": round(fwd_ms, 4),
        "forward_wall_ms": round(fwd_wall * 1e3, 4),
        "engine_step_ms": round(tick_ms, 4),
        "forward_tok_s": round(batch / fwd_ms * 1e3, 1),
        "engine_tok_s": round(batch / tick_ms * 1e3, 1),
        "overlap_step_ms": round(overlap_ms, 4),
        # the tail: where the host's share of a tick meets the GPU's, the step flips between
        # two levels from run to run; p90 shows which one a run sat on
        "overlap_step_p90_ms": round(sorted(overlapped)[int(0.9 * len(overlapped))] * 1e3, 4),
        "overlap_wall_ms": round(overlap_wall * 1e3, 4),
        "overlap_tok_s": round(batch / overlap_ms * 1e3, 1),
        "overlap_over_forward": round(overlap_ms / fwd_ms, 3),
        # ticks that replayed a graph, of those measured: a step run eagerly shows here
        "plain_graph_ticks": f"{r1 - r0}/{args.warmup + args.steps}",
        "overlap_graph_ticks": f"{r2 - r1}/{args.warmup + args.steps}",
        **probed,
    }


def decode_engine(
    path: Path,
    args: argparse.Namespace,
    max_len: int,
    prompt: int = 0,
    prefill_tokens: int = PREFILL_TOKENS,
    index_k_dtype: str = "auto",
) -> Engine:
    """An engine for max(args.batches) requests of up to `max_len` tokens each (KV for all of
    them), prefilling `prefill_tokens` a step, graphs unless --eager. `prompt` > 0: room for
    one more request, a `prompt`-token prompt in one chunk beside the decodes."""
    top = max(args.batches)
    max_len = max(max_len, prompt + 16)
    tokens = (top + (prompt > 0)) * (-(-max_len // PAGE_SIZE) * PAGE_SIZE)
    return build_engine(
        path,
        dtype=args.dtype,
        device=args.device,
        page_size=PAGE_SIZE,
        max_batched_tokens=max(prefill_tokens, top + prompt),
        max_running=top + (prompt > 0),
        kv_budget_mb=kv_budget_mb(path, getattr(torch, args.dtype), tokens, index_k_dtype),
        max_model_len=max_len,
        attention_backend=getattr(args, "backend", None),
        enforce_eager=args.eager,
        index_k_dtype=index_k_dtype,
    )


def kv_budget_mb(path: Path, dtype: torch.dtype, tokens: int, index_k: str = "auto") -> float:
    """A pool for `tokens` tokens (a quarter more), sized by the model's own KV layout (k and
    v; MLA's latent, V3.2's index-K)."""
    arch = ModelArch.from_dir(path)
    dtype_name = str(dtype).removeprefix("torch.")
    layout = KVLayout.for_model(arch, dtype_name, PAGE_SIZE, index_k=index_k)
    per_token = layout.page_bytes / layout.page_size
    return max(64.0, 1.25 * tokens * per_token / 2**20)


# ---------------------------------------------------------------- the run


def bench_model(
    name: str, args: argparse.Namespace, ceilings: dict[str, float], report: Report
) -> None:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    path = resolve_model(f"builtin:{name}")
    report.meta.setdefault("model_build_s", {})[name] = round(time.perf_counter() - t0, 1)
    max_len = args.ctx + max_new_tokens(max(args.batches), args) + 64
    engine = decode_engine(path, args, max_len, prefill_tokens=args.prefill_tokens)
    freeze_startup_heap()  # as a server does before it serves (pdserve/runtime/gc_freeze.py)
    runner = engine.runner
    graphs = runner.graphs
    if graphs is not None:
        cap = graphs.capture_report
        report.meta.setdefault("graph_capture_s", {})[name] = cap.seconds if cap else None
    try:
        for batch in args.batches:
            before = graphs.replays if graphs is not None else 0
            row = run_pdserve(engine, runner, batch, args)
            row["graphs"] = graphs is not None and graphs.replays > before
            row.update(roofline(step_cost(engine, batch, row["ctx"]), ceilings))
            row["forward_over_roofline"] = round(row["forward_ms"] / row["roofline_ms"], 2)
            row["engine_over_roofline"] = round(row["engine_step_ms"] / row["roofline_ms"], 2)
            report.add(name, batch, row)
    finally:
        gc.unfreeze()  # this process goes on (HF, the next model): its garbage is collectable
    del engine, runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.skip_hf:
        return
    hf_rows = hf_decode_steps(
        path,
        args.hf_batches,
        ctx=args.ctx,
        steps=args.steps,
        dtype=dtype,
        device=device,
        compile_mode=args.hf_compile,
        reps=args.hf_reps,
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for batch, hf in hf_rows.items():
        pd = report.rows.get((name, batch), {})
        if "engine_step_ms" in pd:
            hf["hf_over_engine"] = round(hf["hf_step_ms"] / pd["engine_step_ms"], 2)
        report.add(name, batch, hf)


class Report:
    """Rows keyed by (model, batch), rewritten to `out` after every change."""

    def __init__(self, out: str | None, meta: dict[str, Any]) -> None:
        self.out = out
        self.meta = meta
        self.rows: dict[tuple[str, int], dict[str, Any]] = {}
        self.models: list[str] = []  # in the order measured

    def ordered(self) -> list[dict[str, Any]]:
        return [
            self.rows[k] for k in sorted(self.rows, key=lambda k: (self.models.index(k[0]), k[1]))
        ]

    def add(self, model: str, batch: int, fields: dict[str, Any]) -> None:
        if model not in self.models:
            self.models.append(model)
        self.rows.setdefault((model, batch), {"model": model, "batch": batch}).update(fields)
        print(f"{model} batch {batch}: {fields}", file=sys.stderr, flush=True)
        if self.out:
            doc = {"meta": self.meta, "rows": self.ordered()}
            Path(self.out).write_text(json.dumps(doc, indent=1))

    def markdown(self) -> str:
        def cell(row: dict[str, Any], key: str) -> str:
            v = row.get(key)
            if v is None or isinstance(v, str | int):
                return "" if v is None else str(v)
            return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"

        cols = [
            ("model", "model"), ("batch", "batch"), ("ctx", "ctx"),
            ("forward_ms", "forward ms"), ("engine_step_ms", "engine step ms"),
            ("overlap_step_ms", "overlapped step ms"),
            ("overlap_over_forward", "overlapped / forward"),
            ("overlap_tok_s", "overlapped tok/s"), ("roofline_ms", "roofline ms"),
            ("forward_over_roofline", "forward / roofline"), ("hf_step_ms", "HF static+compile ms"),
            ("hf_tok_s", "HF tok/s"), ("hf_over_engine", "HF / engine step"),
        ]  # fmt: skip
        lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
        for row in self.ordered():
            lines.append("| " + " | ".join(cell(row, k) for k, _ in cols) + " |")
        return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x]

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen2-0.5b-shape,llama3.2-1b-shape")
    ap.add_argument("--batches", type=ints, default=[1, 8, 32, 128, 256])
    ap.add_argument("--hf-batches", type=ints, default=[1, 32])
    ap.add_argument("--ctx", type=int, default=320, help="prompt tokens before decoding")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per measurement")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--prefill-tokens", type=int, default=PREFILL_TOKENS, help="the step budget prefilling"
    )
    ap.add_argument(
        "--warm-prefill", action="store_true", help="prompts through the prefix cache (prefill)"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--backend", default=None, help="attention backend (default: the device's)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (--enforce-eager)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--hf-compile", default="reduce-overhead", help="torch.compile mode for HF, or none"
    )
    ap.add_argument("--hf-reps", type=int, default=3, help="timed generate calls per length")
    ap.add_argument("--out", default=None, help="JSON file, rewritten after every row")
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    if min(args.batches + args.hf_batches) < 1 or args.ctx < 1 or args.steps < 1:
        ap.error("batches, --ctx and --steps must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    meta: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items()},
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        meta["transformers"] = None
    meta["ceilings"] = ceilings = measure_ceilings(device, getattr(torch, args.dtype))
    print(f"ceilings: {ceilings}", file=sys.stderr, flush=True)
    report = Report(args.out, meta)
    for name in args.models:
        bench_model(name, args, ceilings, report)
    print(report.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
