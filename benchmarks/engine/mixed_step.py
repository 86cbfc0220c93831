"""What a step that carries a prefill costs the requests decoding beside it, on one GPU.

Under a serving load new prompts arrive every few ticks, and the tick that computes one is a
gap every decoding request waits through. This times `ModelRunner.forward` (the batch build,
its upload, the model, the logits: what a tick launches) for B requests decoding at context
~--ctx, with and without one new prompt's chunk of P tokens:

  * decode: the B decode chunks alone (a CUDA graph when the batch fits a bucket);
  * prefill: the P-token chunk alone (a prefill graph when a bucket holds it,
    engine/prefill_graphs.py);
  * mixed: the B decodes and the chunk in one step, as `engine.runner.forward` runs it (one
    prefill graph of B + P tokens, the decodes in its decode section, when a bucket holds it;
    `prefill_graph` says whether it did);
  * each again eagerly (`_eager`), with the graphs set aside: every step before prefill graphs.

A mixed step of B + P tokens needs a bucket of that many: pass `--cuda-graph-max-tokens` at
least max(batches) + max(prefills) to graph every row (the default, 2,048, leaves the 2,048
-token prompt beside decodes eager).

Each is timed between CUDA events after a warm-up (the median of --steps calls): GPU time when
the GPU is the bottleneck, launch time when the host is. Running one chunk list again and
again rewrites the same KV slots, so every call computes the same step.

    python3 benchmarks/engine/mixed_step.py --out $OUT/mixed.json            # the H200 run
    python benchmarks/engine/mixed_step.py --device cpu --model tiny --batches 2 --prefills 8 \\
        --ctx 24 --steps 2 --warmup 1                                  # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.gpu_decode import check_none_ended, kv_budget_mb, prefill  # noqa: E402
from benchmarks.kernels.roofline import sync, time_steps  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.offline import build_engine  # noqa: E402
from pdserve.engine.scheduler import Chunk  # noqa: E402
from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.protocol.sampling import SamplingParams  # noqa: E402

PAGE_SIZE = 16


def ms_of(engine: Engine, chunks: Sequence[Chunk], args: argparse.Namespace) -> float:
    """Median forward time of `chunks`, in ms, between CUDA events (back to back)."""
    device = engine.pool.device
    times = time_steps(lambda: engine.runner.forward(chunks), device, args.warmup, args.steps)
    return round(statistics.median(times) * 1e3, 4)


def host_ms(engine: Engine, chunks: Sequence[Chunk], args: argparse.Namespace) -> float:
    """Median host time of one forward call of `chunks` launched onto an idle device, in ms:
    what the CPU spends launching it (beside `ms_of`, which of the two sets the pace)."""
    device = engine.pool.device
    out = []
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        engine.runner.forward(chunks)
        out.append(time.perf_counter() - t0)
    sync(device)
    return round(statistics.median(out) * 1e3, 4)


def eager_ms(engine: Engine, chunks: Sequence[Chunk], args: argparse.Namespace) -> float:
    """`ms_of` with the graphs set aside: the step run eagerly."""
    runner = engine.runner
    graphs, prefill = runner.graphs, runner.prefill_graphs
    runner.graphs = runner.prefill_graphs = None
    try:
        return ms_of(engine, chunks, args)
    finally:
        runner.graphs, runner.prefill_graphs = graphs, prefill


def prefill_replays(engine: Engine) -> int:
    graphs = engine.runner.prefill_graphs
    return 0 if graphs is None else graphs.replays


def with_prompt(engine: Engine, tokens: int, seed: int) -> list[Chunk]:
    """The next step as the scheduler plans it once a `tokens`-long prompt has arrived: the
    decodes, then the prompt's one chunk. Planning again plans the same step: nothing here
    advances a request."""
    vocab = min(engine.model.arch.vocab_size, 4000)
    g = torch.Generator().manual_seed(10_000 + seed)
    prompt = torch.randint(3, vocab, (tokens,), generator=g).tolist()
    params = SamplingParams(max_tokens=1, temperature=0)
    engine.scheduler.add(engine.make_request(f"p{seed}", prompt, params, lambda _: None, None))
    chunks = engine.scheduler.schedule().chunks
    if chunks[-1].request.request_id != f"p{seed}" or chunks[-1].length != tokens:
        raise RuntimeError(f"the {tokens}-token prompt is not one chunk of the next step")
    return chunks


def bench_batch(engine: Engine, batch: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    ended: dict[str, str] = {}
    ids = prefill(engine, batch, args.ctx, max_tokens=4 * args.steps + 64, ended=ended)
    engine.sync()
    sync(engine.pool.device)
    check_none_ended(ended)
    decodes = [c for c in engine.scheduler.schedule().chunks if c.length == 1]
    if len(decodes) != batch:
        raise RuntimeError(f"{len(decodes)} of {batch} requests decode in the next step")
    dec, dec_eager = ms_of(engine, decodes, args), eager_ms(engine, decodes, args)
    dec_host = host_ms(engine, decodes, args)
    rows = []
    for i, p in enumerate(args.prefills):
        chunks = with_prompt(engine, p, seed=batch * 1000 + i)
        pf_ms = ms_of(engine, chunks[-1:], args)
        replays = prefill_replays(engine)
        mixed = ms_of(engine, chunks, args)
        graphed = prefill_replays(engine) > replays
        pf_host, mixed_host = host_ms(engine, chunks[-1:], args), host_ms(engine, chunks, args)
        pf_eager, mixed_eager = eager_ms(engine, chunks[-1:], args), eager_ms(engine, chunks, args)
        rows.append(
            {
                "batch": batch,
                "prefill_tokens": p,
                "prefill_graph": graphed,
                "decode_ms": dec,
                "prefill_ms": pf_ms,
                "mixed_ms": mixed,
                "decode_eager_ms": dec_eager,
                "prefill_eager_ms": pf_eager,
                "mixed_eager_ms": mixed_eager,
                "decode_host_ms": dec_host,
                "prefill_host_ms": pf_host,
                "mixed_host_ms": mixed_host,
                "mixed_over_decode": round(mixed / dec, 2),
                "mixed_eager_over_mixed": round(mixed_eager / mixed, 2),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        engine.abort(f"p{batch * 1000 + i}")
        engine.tick()
        engine.sync()  # no step in flight: the next plan has every input on the host
    for rid in ids:
        engine.abort(rid)
    engine.tick()
    engine.sync()
    return rows


def main(argv: list[str] | None = None) -> int:
    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x]

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3.2-1b-shape")
    ap.add_argument("--batches", type=ints, default=[32, 128])
    ap.add_argument("--prefills", type=ints, default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--ctx", type=int, default=320)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cuda-graph-max-tokens", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    path = resolve_model(f"builtin:{args.model}")
    top = max(args.batches) + 1
    max_len = max(args.ctx + 4 * args.steps + 128, max(args.prefills) + 16)
    engine = build_engine(
        path,
        dtype=args.dtype,
        device=args.device,
        page_size=PAGE_SIZE,
        max_batched_tokens=max(args.batches) + max(args.prefills),
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        max_running=top,
        kv_budget_mb=kv_budget_mb(path, getattr(torch, args.dtype), 2 * top * max_len),
        max_model_len=max_len,
        prefix_cache=False,
    )
    rows = [r for b in args.batches for r in bench_batch(engine, b, args)]
    print(json.dumps(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
