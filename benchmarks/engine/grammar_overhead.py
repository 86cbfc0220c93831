"""What structured output costs a decode batch: a batch of --batch requests decoding together,
without grammars, with a JSON schema on half the rows (--modes none,half; `all` puts it on
every row).

Every mode runs the same prompts (--input-len random ids) for --output-len tokens each. The
grammar rows follow one JSON schema (an object holding an array of at least 64 records:
integers, numbers, bounded strings, an enum and a string list), long enough that no row
completes it within --output-len, so every step of the window decodes the whole batch; the
other rows ignore EOS. Greedy unless --temperature. The window is the decode steps from the
first step after every row has its first token to the first end (a length stop): the steps
where the batch is full.

Reported per mode: decode tokens/s (the batch's tokens over the window's wall time), the
median and p90 step time (one `Engine.tick`, host wall: on CUDA overlapped, so it includes
waiting for the device), and the host time per step spent computing grammar masks (inside
`Grammars.mask`: llguidance's bitmasks into one buffer, then the upload) and advancing the
matchers (`Grammars.accept`, once per emitted constrained token). With grammars the
overlapped loop completes the step in flight before sampling (engine/inflight.py), which is
part of what `half` costs on CUDA. Each mode is run --repeats times after one warm-up run
(CUDA graphs, Triton compiles, the grammar's vocabulary and compile); the best run is kept.

    python benchmarks/engine/grammar_overhead.py                           # a GPU, defaults
    python benchmarks/engine/grammar_overhead.py --device cpu --model builtin:tiny \\
        --dtype float32 --output-len 32 --input-len 16                     # a CPU smoke run
    python benchmarks/engine/grammar_overhead.py --model builtin:smollm2-135m-instruct \\
        --dtype float32                   # a real tokenizer's vocabulary (49152 tokens)

Prints one JSON row per mode (and writes them to --out if given).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.offline import build_engine  # noqa: E402
from pdserve.engine.request import RequestOutput  # noqa: E402
from pdserve.engine.sampling.grammars import Grammars  # noqa: E402
from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.protocol.constraint import Constraint, ConstraintKind  # noqa: E402
from pdserve.protocol.sampling import SamplingParams  # noqa: E402

RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 24},
        "price": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "kind": {"enum": ["book", "tool", "food"]},
    },
    "required": ["id", "name", "price", "tags", "kind"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": RECORD, "minItems": 64}},
    "required": ["records"],
}
CONSTRAINT = Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=json.dumps(SCHEMA))
SHARE = {"none": 0.0, "half": 0.5, "all": 1.0}


class Timed:
    """Host seconds inside the engine's Grammars.mask and .accept (wrapped on the instance)."""

    def __init__(self, grammars: Grammars) -> None:
        self.mask_s = self.accept_s = 0.0
        mask, accept = grammars.mask, grammars.accept

        def timed_mask(*a: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return mask(*a)
            finally:
                self.mask_s += time.perf_counter() - t0

        def timed_accept(*a: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return accept(*a)
            finally:
                self.accept_s += time.perf_counter() - t0

        grammars.mask = timed_mask  # type: ignore[method-assign]
        grammars.accept = timed_accept  # type: ignore[method-assign]


def one_run(engine: Engine, args: argparse.Namespace, mode: str, timed: Timed) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    vocab = min(engine.model.arch.vocab_size, 4000)
    prompts = torch.randint(3, vocab, (args.batch, args.input_len), generator=g).tolist()
    constrained = round(args.batch * SHARE[mode])
    counts = [0] * args.batch
    ended: list[RequestOutput] = []
    for i, prompt in enumerate(prompts):
        # Constrained rows spread over the batch (every other row for `half`).
        spread = i * constrained // args.batch != (i + 1) * constrained // args.batch
        params = SamplingParams(
            max_tokens=args.output_len,
            temperature=args.temperature,
            seed=i,
            ignore_eos=True,
            constraint=CONSTRAINT if spread else None,
        )

        def sink(o: RequestOutput, i: int = i) -> None:
            counts[i] += len(o.token_ids)
            if o.finish_reason is not None:
                ended.append(o)

        engine.submit(f"{mode}-{i}-{time.monotonic_ns()}", prompt, params, sink)
    deadline = time.monotonic() + args.timeout
    while min(counts) == 0:  # prefill: every row gets its first token
        engine.tick()
        if time.monotonic() > deadline:
            raise RuntimeError("prefill did not finish in time")
    steps: list[float] = []
    mask0, accept0 = timed.mask_s, timed.accept_s
    tokens0, t_open = sum(counts), time.perf_counter()
    while not ended:
        t0 = time.perf_counter()
        engine.tick()
        steps.append(time.perf_counter() - t0)
        if time.monotonic() > deadline:
            raise RuntimeError("decode did not finish in time")
    wall, tokens = time.perf_counter() - t_open, sum(counts) - tokens0
    mask_s, accept_s = timed.mask_s - mask0, timed.accept_s - accept0
    while engine.has_work():
        engine.tick()
    failed = [o for o in ended if o.finish_reason not in ("length", "stop")]
    if failed:
        raise RuntimeError(f"a request failed: {failed[0].error}")
    if any(o.finish_reason != "length" for o in ended):
        raise RuntimeError("a row ended before --output-len: the window is not a full batch")
    steps.sort()
    return {
        "mode": mode,
        "constrained_rows": constrained,
        "batch": args.batch,
        "steps": len(steps),
        "decode_tok_s": round(tokens / wall, 1),
        "step_p50_ms": round(statistics.median(steps) * 1e3, 3),
        "step_p90_ms": round(steps[int(0.9 * (len(steps) - 1))] * 1e3, 3),
        "mask_ms_per_step": round(mask_s / len(steps) * 1e3, 3),
        "accept_ms_per_step": round(accept_s / len(steps) * 1e3, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:llama3.2-1b-shape")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--modes", default="none,half", help="comma-separated: none, half, all")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-budget-mb", type=float, default=None, help="default 2048 (GPU), 256")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in SHARE]:
        ap.error(f"unknown mode {unknown[0]!r}: choose from {', '.join(SHARE)}")
    cuda = args.device.startswith("cuda")
    engine = build_engine(
        resolve_model(args.model),
        dtype=args.dtype,
        device=args.device,
        max_batched_tokens=max(args.batch * args.input_len, 512),
        max_running=args.batch,
        kv_budget_mb=args.kv_budget_mb or (2048.0 if cuda else 256.0),
        max_model_len=args.input_len + args.output_len + 16,
    )
    timed = Timed(engine.grammars)
    rows = []
    for mode in modes:
        one_run(engine, args, mode, timed)  # warm-up
        runs = [one_run(engine, args, mode, timed) for _ in range(args.repeats)]
        best = max(runs, key=lambda r: r["decode_tok_s"])
        best.update(model=args.model, device=args.device, dtype=args.dtype)
        rows.append(best)
        print(json.dumps(best), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
