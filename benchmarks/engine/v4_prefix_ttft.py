"""DeepSeek-V4's prefix cache: a repeated conversation's time to first token, with the cache
and without it, side by side on one engine build each (issue 40's target: <= 0.5x).

    python benchmarks/engine/v4_prefix_ttft.py [--model builtin:deepseek-v4-tiny] \
        [--first 1500] [--more 60] [--repeats 3] [--device cpu]

Turn 1: a prompt of --first tokens and a 16-token greedy reply. Turn 2: that conversation plus
--more new tokens; its TTFT (submit to first token, the engine ticked in this thread) is
measured on an engine that served turn 1 (the cache holds its pages) and on one without a
cache; both answers must be equal (the cache changes nothing but the time). Prints each
repeat and the median ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.offline import build_engine, generate  # noqa: E402
from pdserve.engine.request import RequestOutput  # noqa: E402
from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.protocol.sampling import SamplingParams  # noqa: E402

REPLY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def ttft(engine: Engine, prompt: list[int], rid: str) -> tuple[float, list[int]]:
    """Seconds to the first token of `prompt`, and its whole greedy answer."""
    outs: list[RequestOutput] = []
    t0 = time.perf_counter()
    engine.submit(rid, prompt, REPLY, outs.append)
    first = None
    for _ in range(100_000):
        if first is None and any(o.token_ids for o in outs):
            first = time.perf_counter() - t0
        if outs and outs[-1].finish_reason is not None:
            break
        engine.tick()
    assert first is not None and outs[-1].finish_reason == "length", outs[-1:]
    return first, [t for o in outs for t in o.token_ids]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:deepseek-v4-tiny")
    ap.add_argument("--first", type=int, default=1500)
    ap.add_argument("--more", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    path = resolve_model(args.model)

    def build(cache: bool) -> Engine:
        return build_engine(
            path, device=args.device, max_batched_tokens=512, kv_budget_mb=128,
            max_running=4, max_model_len=2048, prefix_cache=cache,
        )  # fmt: skip

    ratios = []
    for r in range(args.repeats):
        first = [(7 * i + 13 * r) % 1900 + 3 for i in range(args.first)]
        cached, plain = build(True), build(False)
        reply = generate(cached, [first], REPLY)[0]
        second = first + reply + [(11 * i + r) % 1900 + 3 for i in range(args.more)]
        with_cache, a = ttft(cached, second, f"c{r}")
        without, b = ttft(plain, second, f"p{r}")
        if a != b:
            print(f"repeat {r}: answers differ with and without the cache: {a} vs {b}")
            return 1
        ratios.append(with_cache / without)
        hit = cached.prefix_cache.stats.hit_tokens if cached.prefix_cache else 0
        print(
            f"repeat {r}: turn 2 of {len(second)} tokens, {hit} from the cache: TTFT "
            f"{with_cache * 1e3:.1f} ms with, {without * 1e3:.1f} ms without "
            f"(x{with_cache / without:.3f})"
        )
    print(f"median ratio with/without: {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
