"""The sampler's time per step: `sample(logits, reqs)` for one batch of rows, per configuration.

    python benchmarks/kernels/sampler.py --device cuda --batch 128 --vocab 151936
    python benchmarks/kernels/sampler.py --device cpu --repeat 3 --only greedy,seeded

Each configuration gives every row the same sampling parameters (a `mixed` one cycles them),
a history of `--history` tokens (prompt + output) for the penalties, and times `sample` from
float32 logits to the host lists it returns, synchronised. `--sampler FILE` times another
implementation of `sample` (e.g. an older revision's `pdserve/engine/sampler.py`, written out
with `git show REV:pdserve/engine/sampler.py > FILE`), for a before/after in one run; rows get
a `generator` attribute for implementations that read one. `--compile-noise` times the current
sampler with its Gumbel noise (the elementwise hash, ~20 passes over [batch, vocab]) fused by
`torch.compile`, after checking the compiled noise against the eager one. Prints one JSON line
per config; the `penalties` config adds a line timing the stateless path (every id uploaded
from the host) against the engine's `Sampler` (counts kept on the device) over decode steps:

    python benchmarks/kernels/sampler.py --device cuda --only penalties --history 320 --repeat 50
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.engine.request import Request  # noqa: E402
from pdserve.protocol.sampling import SamplingParams  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "random": {"temperature": 1.0},
    "seeded": {"temperature": 0.8, "seed": 1},
    "top_k": {"temperature": 0.8, "top_k": 50, "seed": 1},
    "top_p": {"temperature": 0.8, "top_p": 0.9, "seed": 1},
    "top_k_p_min_p": {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.05, "seed": 1},
    "penalties": {
        "temperature": 0.8,
        "seed": 1,
        "repetition_penalty": 1.1,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.5,
    },
    "logprobs": {"temperature": 0.8, "seed": 1, "logprobs": 5},
}
MIXED = ["greedy", "random", "top_p", "penalties"]


def load_sample(path: str | None) -> Callable[..., Any]:
    if path is None:
        from pdserve.engine.sampler import sample

        return sample
    spec = importlib.util.spec_from_file_location("alt_sampler", path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn: Callable[..., Any] = mod.sample
    return fn


def compile_noise(device: str, batch: int, vocab: int) -> dict[str, Any]:
    """Swap the sampler's noise for a compiled one; report whether it equals the eager one."""
    from pdserve.engine.sampling import processors, random_stream

    eager = random_stream.gumbel_noise
    fused = torch.compile(eager, dynamic=True)
    keys = torch.randint(0, 2**32, (batch, 2), dtype=torch.int64, device=device)
    a, b = eager(keys, vocab), fused(keys, vocab)
    processors.gumbel_noise = fused  # type: ignore[assignment]
    return {
        "noise_bit_identical": bool(torch.equal(a, b)),
        "noise_max_diff": float((a - b).abs().max()),
    }


def make_rows(names: list[str], batch: int, vocab: int, history: int) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(batch):
        kw = dict(CONFIGS[names[i % len(names)]])
        if "seed" in kw:
            kw["seed"] = 1000 + i
        ids = torch.randint(0, vocab, (history,), generator=g).tolist()
        req = Request(
            f"r{i}",
            ids[: history // 2],
            SamplingParams(max_tokens=history, **kw),
            sink=lambda _o: None,
            eos_token_ids=frozenset({0}),
        )
        req.output_ids = ids[history // 2 :]
        # For implementations that keep a torch.Generator per seeded request (before #13).
        seed = kw.get("seed")
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        req.generator = gen  # type: ignore[attr-defined]
        rows.append(req)
    return rows


def time_config(
    sample: Callable[..., Any], rows: list[Request], logits: torch.Tensor, repeat: int
) -> dict[str, float]:
    dev = logits.device
    sample(logits, rows)  # warm-up (allocator, lazy init)
    times = []
    for _ in range(repeat):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        sample(logits, rows)  # returns host lists: its own device->host copy synchronises
        times.append(time.perf_counter() - t0)
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3}


def time_penalties(rows: list[Request], logits: torch.Tensor, repeat: int) -> dict[str, Any]:
    """The penalised rows' step two ways, side by side on the same rows: `sample` uploading
    every prompt + output id from the host (the stateless path, as before the device state)
    and the engine's `Sampler`, whose counts live on the device (built at the first, untimed
    step; then each step counts its own draws). Each step's tokens join the rows' outputs, as
    in decoding; both paths must draw the same tokens."""
    from pdserve.engine.sampler import Sampler, sample

    dev = logits.device
    sampler = Sampler(max_slots=len(rows))

    def timed(fn: Callable[[], list[int]]) -> tuple[list[int], float]:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        ids = fn()  # host lists: its own device->host copy synchronises
        return ids, time.perf_counter() - t0

    host_ids: list[float] = []
    device_state: list[float] = []
    same = True
    for step in range(repeat + 1):  # step 0: warm-up, and the slots are built
        old, t_old = timed(lambda: sample(logits, rows)[0])
        new, t_new = timed(lambda: sampler.launch(logits, rows).result()[0])
        same = same and old == new
        for r, tok in zip(rows, new, strict=True):
            r.output_ids.append(tok)
        if step:
            host_ids.append(t_old)
            device_state.append(t_new)
    state = sampler.penalties
    slot_bytes = (
        0
        if state.counts is None or state.seen is None
        else (state.counts[0].nbytes + state.seen[0].nbytes)
    )
    return {
        "host_ids_median_ms": statistics.median(host_ids) * 1e3,
        "device_state_median_ms": statistics.median(device_state) * 1e3,
        "host_ids_min_ms": min(host_ids) * 1e3,
        "device_state_min_ms": min(device_state) * 1e3,
        "same_tokens": same,
        "state_mib": state.capacity * slot_bytes / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--history", type=int, default=512, help="prompt + output tokens per row")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated configs (default: all + mixed)")
    ap.add_argument("--sampler", default=None, help="a file defining sample(logits, reqs)")
    ap.add_argument("--compile-noise", action="store_true", help="fuse the noise (see above)")
    args = ap.parse_args()
    sample = load_sample(args.sampler)
    if args.compile_noise:
        print(json.dumps(compile_noise(args.device, args.batch, args.vocab)), flush=True)
    names = args.only.split(",") if args.only else [*CONFIGS, "mixed"]
    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(1))
    logits = (logits * 3).to(args.device)
    for name in names:
        kinds = MIXED if name == "mixed" else [name]
        rows = make_rows(kinds, args.batch, args.vocab, args.history)
        result = time_config(sample, rows, logits, args.repeat)
        line = {"config": name, "batch": args.batch, "vocab": args.vocab, "device": args.device}
        label = args.sampler or ("current+compiled-noise" if args.compile_noise else "current")
        print(json.dumps({**line, "sampler": label, **result}), flush=True)
        if name == "penalties" and args.sampler is None:
            rows = make_rows(kinds, args.batch, args.vocab, args.history)
            both = time_penalties(rows, logits, args.repeat)
            print(json.dumps({**line, "sampler": "host ids vs device state", **both}), flush=True)


if __name__ == "__main__":
    main()
