"""A decode step on a GPU that another process prefills on: what one shared GPU costs 1P+1D.

    python benchmarks/engine/gpu_sharing.py --model llama3.2-1b-shape --batch 32 --rates 0,25,50,100
    python benchmarks/engine/gpu_sharing.py --device cpu --model tiny --batch 2 --ctx 40 \\
        --rates 0,20 --steps 5                                       # a CPU smoke run

A 1P+1D cluster on one GPU runs its prefill worker and its decode worker as two processes on
the same device. Without MPS, kernels of two processes never run at the same time: the GPU
time-slices between their contexts, so every prefill the prefill worker runs delays the decode
worker's steps, which a co-located server (one process, prefill chunks inside its own steps)
does not pay in the same way. This separates that cost from pdserve's own.

The decode side is benchmarks/engine/gpu_decode.py's: `--batch` requests at context ~`--ctx` in one
engine, and the overlapped step (Engine.tick() with overlapped scheduling, CUDA graphs) timed
step by step with CUDA events; its p50 and p90 are reported. At each --rates R > 0 a second
process (this script, --load) loads the same model into its own engine and prefills R
`--prompt-len`-token prompts a second (one max_tokens=1 request each, submitted in bursts
of --burst), as a prefill worker would; the decode steps are timed while it runs. R = 0 is the
decode alone. The load process reports the prompts it prefilled and the seconds it spent in
its engine, so its share of the GPU is printed beside the step.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.gpu_decode import check_none_ended, decode_engine, prefill  # noqa: E402
from benchmarks.kernels.roofline import time_steps  # noqa: E402
from pdserve.engine.request import RequestOutput  # noqa: E402
from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.protocol.sampling import SamplingParams  # noqa: E402

READY_TIMEOUT_S = 300.0  # the load process builds (or loads) the model, then says "ready"
STOP_TIMEOUT_S = 60.0
BURST_TIMEOUT_S = 60.0  # the load's prefills of one burst


def load(args: argparse.Namespace) -> int:
    """The load process: prefill `rate` prompts a second until stdin closes; then print
    {"prompts": n, "busy_s": s, "wall_s": s} as JSON."""
    path = resolve_model(f"builtin:{args.model}")
    args.batches = [args.burst]
    engine = decode_engine(path, args, max_len=args.prompt_len + 8)
    vocab = min(engine.model.arch.vocab_size, 4000)
    g = torch.Generator().manual_seed(7)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    done: list[str] = []

    def burst(tag: str) -> float:
        t0 = time.perf_counter()
        before = len(done)
        for i in range(args.burst):
            prompt = torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()

            def sink(out: RequestOutput) -> None:
                if out.finish_reason is not None:
                    done.append(out.finish_reason)

            engine.submit(f"{tag}-{i}", prompt, params, sink)
        deadline = time.monotonic() + BURST_TIMEOUT_S
        while len(done) - before < args.burst:
            if time.monotonic() > deadline:
                raise RuntimeError(f"a burst of {args.burst} prefills unfinished after 60 s")
            engine.tick()
        engine.sync()
        return time.perf_counter() - t0

    for w in range(3):
        burst(f"warm{w}")
    print("ready", flush=True)
    period = args.burst / args.rate
    prompts, busy, t0 = 0, 0.0, time.perf_counter()
    next_at = t0
    n = 0
    while not select.select([sys.stdin], [], [], 0)[0]:  # stdin closed or written: stop
        now = time.perf_counter()
        if now < next_at:
            time.sleep(min(next_at - now, 0.01))
            continue
        busy += burst(f"p{n}")
        prompts += args.burst
        n += 1
        next_at += period
    print(json.dumps({"prompts": prompts, "busy_s": busy, "wall_s": time.perf_counter() - t0}))
    return 0


def start_load(args: argparse.Namespace, rate: float) -> subprocess.Popen[bytes]:
    """The load process, once it said "ready" (bounded); killed if it did not."""
    cmd = [
        sys.executable, __file__, "--load", "--rate", str(rate), "--model", args.model,
        "--device", args.device, "--dtype", args.dtype, "--burst", str(args.burst),
        "--prompt-len", str(args.prompt_len),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        said = b""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while b"\n" not in said:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                raise RuntimeError(f"the load process said no ready line in {READY_TIMEOUT_S}s")
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the load process exited (code {proc.wait(STOP_TIMEOUT_S)})")
            said += chunk
        if said.split(b"\n")[0].strip() != b"ready":
            raise RuntimeError(f"the load process did not start (said {said[:200]!r})")
    except BaseException:
        kill(proc)
        raise
    return proc


def kill(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait(STOP_TIMEOUT_S)


def stop_load(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """Tell the load process to stop (it reads stdin); its report. Killed past the bound."""
    try:
        out, _ = proc.communicate(b"stop\n", timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill(proc)
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"the load process failed (exit {proc.returncode})")
    return json.loads(out.decode().strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3.2-1b-shape")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=320)
    ap.add_argument("--rates", default="0,25,50,100", help="prompts/s the other process prefills")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--burst", type=int, default=1, help="prompts the load submits at once")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.eager = False
    if args.load:
        return load(args)
    device = torch.device(args.device)
    args.batches = [args.batch]
    rates = [float(r) for r in args.rates.split(",") if r]
    steps_total = (args.steps + 5) * len(rates)
    max_len = args.ctx + steps_total + 16  # never ends inside the measurement
    engine = decode_engine(resolve_model(f"builtin:{args.model}"), args, max_len)
    engine.overlap = True
    ended: dict[str, str] = {}
    prefill(engine, args.batch, args.ctx, steps_total + 8, ended)
    rows = []
    for rate in rates:
        proc = start_load(args, rate) if rate > 0 else None
        try:
            steps = sorted(time_steps(engine.tick, device, 5, args.steps))
            loaded = stop_load(proc) if proc is not None else None
            proc = None
        finally:
            if proc is not None:  # the measurement failed: the load is killed, not asked
                kill(proc)
        check_none_ended(ended)
        row: dict[str, Any] = {
            "rate": rate,
            "step_p50_ms": round(statistics.median(steps) * 1e3, 4),
            "step_p90_ms": round(steps[int(0.9 * len(steps))] * 1e3, 4),
            "step_mean_ms": round(statistics.fmean(steps) * 1e3, 4),
        }
        if loaded is not None:
            row["load_prompts_s"] = round(loaded["prompts"] / loaded["wall_s"], 1)
            row["load_busy"] = round(loaded["busy_s"] / loaded["wall_s"], 3)
        if rows:
            row["p50_vs_alone"] = round(row["step_p50_ms"] / rows[0]["step_p50_ms"], 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    engine.sync()
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
