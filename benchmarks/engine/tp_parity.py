"""Greedy texts at TP 2 and 4 against TP 1, prompt by prompt (issue 42's target): float32,
builtin tiny (or --model, DeepSeek's tiny ones expert parallel), one engine in this process
leading its follower ranks over gloo (the engine of
tests/parallel/test_tp_engine.py).

Every prompt's greedy tokens (ignore_eos, --output-len each) at TP N are compared with TP 1's.
A prompt whose tokens differ must first differ at a near-tie: where the TP-1 run's two best
logprobs at that token are less than TIE (1e-4) apart (a logprob gap is the logit gap), a
reduction done in another order may pick the other one. The target: identical on at least
--min-identical of --prompts, and every difference at a near-tie. Each TP runs the same
schedule (the same pool pages, chunk size and batch), so a difference is the arithmetic's.

Prints one line per TP (identical, near ties, real divergences, the wall time) and, with
--out, writes them as JSON; exits 1 if a TP misses the target.

    python benchmarks/engine/tp_parity.py                                   # TP 2 and 4, 64 x 32
    python benchmarks/engine/tp_parity.py --tp 2 --prompts 16 --output-len 16   # a quick one
    python benchmarks/engine/tp_parity.py --model builtin:deepseek-v3-tiny --tp 2,4   # EP
    python benchmarks/engine/tp_parity.py --model builtin:deepseek-v3-tiny --tp 2,4 --dp
        # --dp N --ep: data-parallel attention over the N ranks (its pool N times TP 1's)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pdserve.engine.offline import build_engine  # noqa: E402
from pdserve.kvcache.layout import KVLayout  # noqa: E402
from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.model.config import ModelArch  # noqa: E402
from pdserve.protocol.outputs import RequestOutput  # noqa: E402
from pdserve.protocol.sampling import SamplingParams  # noqa: E402
from pdserve.runtime.pids import wait_gone  # noqa: E402

TIE = 1e-4  # a top-2 logprob gap below this is a near-tie
PAGES = 640  # at every TP: room for every prompt at once (64 x 8 pages of 16 tokens)
PAGE = 16
ENGINE = {"max_batched_tokens": 256, "max_model_len": 512, "page_size": PAGE,
          "prefix_cache": False}  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One prompt's greedy tokens and, per token, its top-2 logprob gap."""

    tokens: list[int]
    gaps: list[float]


@dataclass
class Parity:
    """TP N against TP 1 over every prompt."""

    tp: int
    prompts: int
    identical: int = 0
    near_ties: list[dict[str, float]] = field(default_factory=list)  # prompt, position, gap
    diverged: list[dict[str, float]] = field(default_factory=list)  # the same, past TIE
    wall_s: float = 0.0

    def meets(self, min_identical: int) -> bool:
        return self.identical >= min_identical and not self.diverged


def prompts_for(vocab: int, n: int, seed: int = 64) -> list[list[int]]:
    """`n` random prompts of 4 to 96 tokens."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(4, 97, (n,), generator=gen).tolist()
    return [torch.randint(vocab, (k,), generator=gen).tolist() for k in lens]


def greedy(
    path: Path, tp: int, prompts: list[list[int]], output_len: int, dp: bool = False
) -> list[Run]:
    """Every prompt's greedy run at `tp` (`dp`: data-parallel attention over its ranks), all
    submitted at once; the followers stopped and gone (by pid) before it returns."""
    torch.set_num_threads(1)  # its ranks share the machine's cores
    # A rank's page holds its share of the KV heads: PAGES pages at every TP.
    arch = ModelArch.from_dir(path)
    layout = KVLayout.for_model(arch.for_rank(tp, 0), "float32", PAGE, tp_rank=0, tp_size=tp)
    engine = build_engine(path, tp=tp, kv_budget_mb=PAGES * layout.page_bytes / 2**20,
                          dp_attention=dp and tp > 1, **ENGINE)  # fmt: skip
    pids = engine.tp.pids if engine.tp is not None else []
    try:
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                                logprobs=2)  # fmt: skip
        outs: dict[int, list[RequestOutput]] = {i: [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):
            engine.submit(f"parity-{i}", p, params, outs[i].append)
        deadline = time.monotonic() + 600.0
        while not all(o and o[-1].finish_reason is not None for o in outs.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"TP {tp}: requests unfinished after 600 s")
            engine.tick()
    finally:
        if engine.tp is not None:
            engine.tp.close()
        if wait_gone(pids, 10.0):
            raise RuntimeError(f"TP {tp}: follower ranks {pids} outlived their engine")
    runs = []
    for i, got in outs.items():
        if got[-1].finish_reason != "length":
            raise RuntimeError(f"TP {tp}: prompt {i} ended {got[-1].finish_reason}: {got[-1]}")
        lps = [lp for o in got for lp in o.logprobs]
        gaps = [lp.top[0][1] - lp.top[1][1] for lp in lps]
        runs.append(Run([t for o in got for t in o.token_ids], gaps))
    return runs


def compare(tp: int, ref: list[Run], got: list[Run]) -> Parity:
    """TP `tp`'s runs against TP 1's (`ref`): identical, or where they first differ."""
    out = Parity(tp, len(ref))
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        at = next(
            (k for k, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y), None
        )
        if at is None and len(a.tokens) == len(b.tokens):
            out.identical += 1
            continue
        at = min(len(a.tokens), len(b.tokens)) if at is None else at
        gap = a.gaps[at] if at < len(a.gaps) else float("inf")
        (out.near_ties if gap < TIE else out.diverged).append(
            {"prompt": i, "position": at, "gap": gap}
        )
    return out


def run(
    path: Path, tps: list[int], n: int, output_len: int, dp: bool = False
) -> tuple[float, list[Parity]]:
    """TP 1's wall time, then each TP's parity against it."""
    prompts = prompts_for(ModelArch.from_dir(path).vocab_size, n)
    t0 = time.monotonic()
    ref = greedy(path, 1, prompts, output_len)
    ref_s = time.monotonic() - t0
    out = []
    for tp in tps:
        t0 = time.monotonic()
        got = greedy(path, tp, prompts, output_len, dp)
        parity = compare(tp, ref, got)
        parity.wall_s = round(time.monotonic() - t0, 2)
        out.append(parity)
    return ref_s, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", default="2,4", help="tensor-parallel sizes, comma-separated")
    p.add_argument(
        "--model", default="builtin:tiny",
        help="builtin:deepseek-v3-tiny / -v32-tiny: expert parallel at each TP (model/moe.py)",
    )  # fmt: skip
    p.add_argument(
        "--dp", action="store_true",
        help="data-parallel attention over each TP's ranks (--dp N --ep; DeepSeek's tiny ones)",
    )  # fmt: skip
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--min-identical", type=int, default=None, help="default: prompts - 1")
    p.add_argument("--out", default=None, help="write the results here as JSON")
    args = p.parse_args()
    tps = [int(x) for x in args.tp.split(",")]
    need = args.prompts - 1 if args.min_identical is None else args.min_identical
    ref_s, results = run(resolve_model(args.model), tps, args.prompts, args.output_len, args.dp)
    what = "DP" if args.dp else "TP"
    print(f"TP 1: {args.prompts} prompts x {args.output_len} tokens in {ref_s:.1f}s")
    for r in results:
        print(
            f"{what} {r.tp}: identical {r.identical}/{r.prompts}, near ties {len(r.near_ties)}, "
            f"diverged {len(r.diverged)} in {r.wall_s:.1f}s: "
            + ("meets the target" if r.meets(need) else "MISSES the target")
            + "".join(f"\n  {d}" for d in r.near_ties + r.diverged)
        )
    if args.out:
        doc = {"tp1_s": round(ref_s, 2), "results": [asdict(r) for r in results]}
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0 if all(r.meets(need) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
