"""The engine alone under a serving load: what a served ITL owes to the engine, not to HTTP.

`benchmarks/serving/gpu_serving.py` measures the whole path (router, worker HTTP, SSE); this
runs the same workload against one `Engine` in this process, driven on this thread as the
server's engine thread drives it, with no HTTP: a closed loop at --concurrency, random prompts of
--input-len tokens, --output-len out (ignore_eos), each finished request replaced by the next
after a random delay of up to --jitter-ms (a served request's successor arrives after the
HTTP path's turnaround, which spreads the prompts over ticks). Every token's time is taken in
its sink, where the server hands it to HTTP: the ITL here is the engine's, and a served ITL
above it is the streaming path's.

Reported per run: output tokens/s, TTFT and ITL p50/p90/p99 from the sinks; the share of
ticks whose step carried a prefill chunk; tick time (host wall, one `Engine.tick`) for ticks
with a prefill chunk and without (a tick that launches none may still wait for one:
overlapped scheduling completes the step before); the engine thread's CPU time per tick; a
decode tick's host share (its wall time less the time it polled the GPU,
runtime/gpu_wait.waited_s) and the share of decode ticks that never waited for the GPU (near
1: the host sets the pace, not the GPU). Every figure comes from one window: from the end of
the first --warmup-prompts requests (Triton compiles, first graph replays) to the submission
of the last prompt (after it the batch only drains). The startup heap is frozen out of the
garbage collector's scans first, as a worker's is (runtime/gc_freeze.py).

    python3 benchmarks/engine/engine_load.py --concurrency 32 --num-prompts 512     # on a GPU
    python benchmarks/engine/engine_load.py --device cpu --model builtin:tiny --concurrency 4 \
        --num-prompts 16 --input-len 16 --output-len 8 --warmup-prompts 4     # a CPU smoke run
    python3 benchmarks/engine/engine_load.py --concurrency 128 --num-prompts 1536 \
        --max-batched-tokens 1024 --profile 2> prof.txt   # where a tick's host time goes
    python benchmarks/engine/engine_load.py --stub-forward --concurrency 128 --num-prompts 1536 \
        --max-batched-tokens 1024        # the engine's host work under that load, any machine

`--stub-forward` replaces the model by the batch build and fixed logits (stub_forward.py) and
overlaps the steps as on a GPU: what is left of a tick is the engine's own host work under
this load (arrivals, prefill chunks, finishes, every token's sink).
"""

from __future__ import annotations

import argparse
import cProfile
import heapq
import io
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.engine.stub_forward import stub_forward  # noqa: E402
from pdserve.bench.metrics import percentile  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.offline import build_engine  # noqa: E402
from pdserve.engine.request import RequestOutput  # noqa: E402
from pdserve.engine.scheduler import StepPlan  # noqa: E402
from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.protocol.sampling import SamplingParams  # noqa: E402
from pdserve.runtime.gc_freeze import freeze_startup_heap  # noqa: E402
from pdserve.runtime.gpu_wait import waited_s  # noqa: E402

PAGE_SIZE = 16


class Load:
    """The closed loop: keeps `concurrency` requests in the engine, times every token."""

    def __init__(self, engine: Engine, args: argparse.Namespace) -> None:
        self.engine, self.args = engine, args
        vocab = min(engine.model.arch.vocab_size, 4000)
        g = torch.Generator().manual_seed(0)
        self.prompts = torch.randint(3, vocab, (args.num_prompts, args.input_len), generator=g)
        self.params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
        self.next = 0  # the next prompt to submit
        self.done = 0
        self.warm_left = min(args.warmup_prompts, args.num_prompts)  # warm-up ones still on
        self.failed: list[str] = []
        # The measured window: from the end of the last warm-up request to the submission of
        # the last prompt (after it the batch only drains, shrinking: not the load asked for).
        self.t_open: float | None = None
        self.t_close: float | None = None
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.window_tokens = 0
        self.total_tokens = 0  # every request's, the warm-up's too: all must be served
        self.due: list[float] = []  # when each replacement will be submitted (a heap)
        self.rng = random.Random(0)

    @property
    def measuring(self) -> bool:
        return self.t_open is not None and self.t_close is None

    def submit_due(self) -> None:
        now = time.perf_counter()
        while self.due and self.due[0] <= now:
            heapq.heappop(self.due)
            self.submit()

    def submit(self) -> None:
        i, self.next = self.next, self.next + 1
        start = time.perf_counter()
        last = [start]
        warmup = i < self.args.warmup_prompts

        def sink(out: RequestOutput) -> None:
            now = time.perf_counter()
            if out.token_ids:
                self.total_tokens += len(out.token_ids)
                if self.measuring:
                    (self.itl if last[0] != start else self.ttft).append(now - last[0])
                    self.window_tokens += len(out.token_ids)
                last[0] = now
            if out.finish_reason is not None:
                self.finished(out, warmup)

        self.engine.submit(f"load-{i}", self.prompts[i].tolist(), self.params, sink)
        if self.next == self.args.num_prompts and self.measuring:
            self.t_close = time.perf_counter()

    def finished(self, out: RequestOutput, warmup: bool) -> None:
        self.done += 1
        if out.finish_reason not in ("length", "stop"):
            self.failed.append(f"{out.finish_reason}: {out.error}")
        if warmup:
            self.warm_left -= 1
            if self.warm_left == 0 and self.next < self.args.num_prompts:
                self.t_open = time.perf_counter()
        if self.next + len(self.due) < self.args.num_prompts:
            delay = self.rng.uniform(0, self.args.jitter_ms) / 1e3
            heapq.heappush(self.due, time.perf_counter() + delay)


def run(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    load = Load(engine, args)
    # (launched a prefill chunk, seconds, of which polling the GPU), in the window
    ticks: list[tuple[bool, float, float]] = []
    # Whether each tick's plan launched a prefill chunk (not the plans: keeping every step's
    # chunks alive would hand the garbage collector a heap no served engine has).
    prefill_launched: list[bool] = []
    step = engine.stepper.step

    def observed_step() -> StepPlan:  # the plan each tick launched, to label the tick
        plan = step()
        prefill_launched.append(any(c.length > 1 for c in plan.chunks))
        return plan

    graphs, pgraphs = engine.runner.graphs, engine.runner.prefill_graphs
    replays = (lambda: graphs.replays) if graphs is not None else (lambda: 0)
    p_replays = (lambda: pgraphs.replays) if pgraphs is not None else (lambda: 0)
    p_reps = [0, 0]
    cpu = [0.0, 0.0]  # this (the engine's) thread's CPU time at the window's two ends
    reps = [0, 0]
    prof = cProfile.Profile() if args.profile else None
    engine.stepper.step = observed_step  # type: ignore[method-assign]
    try:
        for _ in range(min(args.concurrency, args.num_prompts)):
            load.submit()
        deadline = time.monotonic() + args.timeout
        while load.done < args.num_prompts and not load.failed:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{load.done}/{args.num_prompts} ended in {args.timeout}s")
            if not engine.has_work() and load.due:  # a tick would wait for the inbox: here
                time.sleep(max(0.0, load.due[0] - time.perf_counter()))
            load.submit_due()
            measuring = load.measuring
            if measuring and not ticks:
                cpu[0], reps[0], p_reps[0] = time.thread_time(), replays(), p_replays()
            t0, w0, n = time.perf_counter(), waited_s(), len(prefill_launched)
            if measuring and prof is not None:
                prof.runcall(engine.tick)
            else:
                engine.tick()
            dt, waited = time.perf_counter() - t0, waited_s() - w0
            if measuring:
                pf = len(prefill_launched) > n and prefill_launched[-1]
                ticks.append((pf, dt, waited))
                cpu[1], reps[1], p_reps[1] = time.thread_time(), replays(), p_replays()
    finally:
        engine.stepper.step = step  # type: ignore[method-assign]
    if prof is not None:
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("cumulative").print_stats(40)
        stats.sort_stats("tottime").print_stats(25)
        print(out.getvalue(), file=sys.stderr)
    if load.failed:
        raise RuntimeError(f"{len(load.failed)} requests failed, e.g. {load.failed[0]}")
    if load.t_open is None or load.t_close is None or not ticks:
        raise RuntimeError("nothing measured: raise --num-prompts well above --warmup-prompts")
    wall = load.t_close - load.t_open
    with_pf = [dt for pf, dt, _ in ticks if pf]
    without = [dt for pf, dt, _ in ticks if not pf]
    host = [dt - w for pf, dt, w in ticks if not pf]  # a decode tick's wall less its GPU waits
    unwaited = sum(w == 0 for pf, _, w in ticks if not pf)
    return {
        "concurrency": args.concurrency,
        "profiled": bool(args.profile),
        "requests": len(load.ttft),  # the requests whose first token came in the window
        "total_tokens": load.total_tokens,
        "window_s": round(wall, 3),
        "itls": len(load.itl),
        "output_tok_s": round(load.window_tokens / wall, 1),
        "ttft_p50_ms": pct_ms(load.ttft, 50),
        "itl_p50_ms": pct_ms(load.itl, 50),
        "itl_p90_ms": pct_ms(load.itl, 90),
        "itl_p99_ms": pct_ms(load.itl, 99),
        "ticks": len(ticks),
        "prefill_tick_share": round(len(with_pf) / len(ticks), 3),
        "tick_prefill_ms": ms(statistics.median(with_pf)) if with_pf else None,
        "tick_decode_ms": ms(statistics.median(without)) if without else None,
        "tick_cpu_ms": ms((cpu[1] - cpu[0]) / len(ticks)),  # CUDA waits spin: counted
        "tick_decode_host_ms": ms(statistics.median(host)) if host else None,
        "decode_ticks_unwaited": round(unwaited / len(host), 3) if host else None,
        "graph_replays": None if graphs is None else reps[1] - reps[0],
        "prefill_graph_replays": None if pgraphs is None else p_reps[1] - p_reps[0],
    }


def pct_ms(xs: list[float], q: float) -> float | None:
    """The q-th percentile in ms, as `pdserve bench` computes it; None for no values."""
    return ms(percentile(xs, q)) if xs else None


def ms(s: float) -> float:
    return round(s * 1e3, 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:llama3.2-1b-shape")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--warmup-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--jitter-ms", type=float, default=0.0, help="a replacement's delay, at most")
    ap.add_argument("--max-batched-tokens", type=int, default=4096, help="as gpu_serving's")
    ap.add_argument(
        "--kv-budget-mb",
        type=float,
        default=None,
        help="default 4096 on a GPU, 256 on the CPU (zeroing a 4 GiB pool there takes seconds)",
    )
    ap.add_argument("--cuda-graph-max-tokens", type=int, default=2048, help="0: prefill eager")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the window's ticks (to stderr): where the host's share goes; it slows "
        "the host, so the row's times are not the engine's",
    )
    ap.add_argument(
        "--stub-forward",
        action="store_true",
        help="no model: the batch build and fixed logits (benchmarks/engine/stub_forward.py), "
        "steps overlapped; the tiny model's engine on the CPU",
    )
    ap.add_argument("--out", default=None, help="a JSON file for the row")
    args = ap.parse_args(argv)
    if args.stub_forward:
        args.model, args.device, args.dtype = "builtin:tiny", "cpu", "float32"
    if args.kv_budget_mb is None:
        args.kv_budget_mb = 4096 if args.device == "cuda" else 256
    engine = build_engine(
        resolve_model(args.model),
        dtype=args.dtype,
        device=args.device,
        page_size=PAGE_SIZE,
        max_batched_tokens=args.max_batched_tokens,
        max_running=args.concurrency,
        kv_budget_mb=args.kv_budget_mb,
        max_model_len=args.input_len + args.output_len + 64,
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        overlap_schedule=True if args.stub_forward else None,
    )
    if args.stub_forward:
        stub_forward(engine)
    freeze_startup_heap()  # as a worker does once started (runtime/gc_freeze.py)
    row = {
        "model": "stub" if args.stub_forward else args.model,
        **run(engine, args),
    }
    print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "row": row}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
