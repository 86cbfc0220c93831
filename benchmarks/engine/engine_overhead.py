"""The engine's own CPU cost per decode step: everything but the model, per request.

On a GPU a decode step is the longer of the GPU's forward and the CPU's share (scheduling,
the batch build, the sampler's launch, emitting tokens); with overlapped scheduling
(engine/inflight.py) the two run side by side, so past some batch the CPU's share *is* the
step. This measures that share on any machine: the built-in `tiny` model's engine, with the
runner's forward replaced by the batch build alone and logits of a small fixed vocabulary, so
only the engine's bookkeeping (and a vocab-64 sampler) runs. Median of --repeats runs.

`--gc` also counts the garbage collector's full (oldest-generation) passes during the timed
steps and their time, with the startup heap frozen (what a server does,
pdserve/runtime/gc_freeze.py) and not; `--heavy-heap` imports transformers first, as a
benchmark process that also runs HF has it.

    python benchmarks/engine/engine_overhead.py               # batches 32, 256; overlap off/on
    python benchmarks/engine/engine_overhead.py --batches 256 --gc --heavy-heap
    python benchmarks/engine/engine_overhead.py --batches 8,64,256 --profile
    python benchmarks/engine/engine_overhead.py --clock process  # CPU time: steadier on a busy box
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.stub_forward import VOCAB, stub_forward  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.offline import build_engine  # noqa: E402
from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.protocol.sampling import SamplingParams  # noqa: E402
from pdserve.runtime.gc_freeze import freeze_startup_heap  # noqa: E402


def engine_for(batch: int, overlap: bool, ctx: int) -> Engine:
    eng = build_engine(
        resolve_model("builtin:tiny"),
        page_size=16,
        max_batched_tokens=batch * (ctx + 1),
        max_running=batch,
        kv_budget_mb=64 + batch * (ctx + 600) * 0.01,
        max_model_len=ctx + 1024,
        overlap_schedule=overlap,
    )
    stub_forward(eng)  # the batch build is the engine's work: kept; no model
    return eng


class FullPasses:
    """The collector's full passes (count, seconds) while it is entered."""

    def __init__(self) -> None:
        self.count, self.seconds, self._t0 = 0, 0.0, 0.0

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._t0

    def __enter__(self) -> FullPasses:
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)


def measure(
    batch: int, overlap: bool, args: argparse.Namespace, freeze: bool = False
) -> tuple[float, FullPasses]:
    """Seconds per tick with `batch` requests decoding, and the full GC passes meanwhile."""
    eng = engine_for(batch, overlap, args.ctx)
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, VOCAB, (batch, args.ctx), generator=g).tolist()
    params = SamplingParams(max_tokens=args.steps * 4 + 64, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, params, lambda _o: None)
    for _ in range(5):  # prefill, then a few decodes
        eng.tick()
    if freeze:
        freeze_startup_heap()
    prof = cProfile.Profile() if args.profile else None
    if prof is not None:
        prof.enable()
    with FullPasses() as passes:
        clock = time.process_time if args.clock == "process" else time.perf_counter
        t0 = clock()
        for _ in range(args.steps):
            eng.tick()
        dt = (clock() - t0) / args.steps
    gc.unfreeze()
    if prof is not None:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    del eng
    gc.collect()  # the engine (its KV pool) is in reference cycles: free it before the next
    return dt, passes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="32,256")
    ap.add_argument("--ctx", type=int, default=320, help="prompt tokens of each request")
    ap.add_argument("--steps", type=int, default=100, help="ticks timed per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="print a cProfile of one run")
    ap.add_argument(
        "--clock",
        choices=("wall", "process"),
        default="wall",
        help="wall time, or this process's CPU time (less disturbed by other load)",
    )
    ap.add_argument("--gc", action="store_true", help="also frozen vs not, and full GC passes")
    ap.add_argument("--heavy-heap", action="store_true", help="import transformers first")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.heavy_heap:
        import transformers  # noqa: F401 - its objects are the heap a full GC pass walks
    print("| batch | overlap | frozen heap | ms per step | µs per request | full GC passes (ms) |")
    print("|---|---|---|---|---|---|")
    for batch in [int(b) for b in args.batches.split(",")]:
        for overlap in (False, True):
            for freeze in (False, True) if args.gc else (False,):
                runs = [measure(batch, overlap, args, freeze) for _ in range(args.repeats)]
                ms = statistics.median(dt for dt, _ in runs) * 1e3
                passes = sum(p.count for _, p in runs), sum(p.seconds for _, p in runs) * 1e3
                print(
                    f"| {batch} | {'on' if overlap else 'off'} | {'yes' if freeze else 'no'} "
                    f"| {ms:.3f} | {ms * 1e3 / batch:.1f} | {passes[0]} ({passes[1]:.0f}) |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
