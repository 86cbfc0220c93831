"""The worker's cost to encode one engine step's outputs for a router's channel (per burst).

    python benchmarks/codec/stream_encode.py [--bursts 1,32,128,256] [--repeats 5]

A burst is what one engine step hands the channel's writer: one RequestOutput per request,
one token each (worker/http/channels.py `encode_burst`). It runs on the worker's event loop, which
shares the GIL with the engine thread, so every µs here is a µs the engine cannot run.
Side by side in one run: the writer's code before 2026-12-04 (`before_burst` here: the outputs
grouped by request, then a line per output joined in Python), one msgspec call for the burst
(`encode_lines`), and `encode_burst` now (a set of ids for the one-output-per-request check,
then `encode_lines`). Median µs per burst of --repeats.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.codec.microbench import us  # noqa: E402
from pdserve.protocol.outputs import RequestOutput, encode_line, encode_lines  # noqa: E402
from pdserve.worker.http.channels import by_request, encode_burst  # noqa: E402


def burst(n: int) -> list[RequestOutput]:
    return [
        RequestOutput(f"cmpl-{i:08x}", (1234 + i,), (), num_prompt_tokens=256) for i in range(n)
    ]


def before_burst(outs: list[RequestOutput]) -> bytes:
    """worker/http/channels.py's encode_burst before 2026-12-04, for the comparison (a burst of
    one output per request, its common case): the outputs grouped by request first, then a
    line per output joined in Python."""
    if len(by_request(outs)) != len(outs):
        raise ValueError("this comparison is for bursts of one output per request")
    return b"".join(encode_line(o) for o in outs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bursts", default="1,32,128,256")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print("| outputs per burst | before µs | encode_lines µs | encode_burst µs | before / now |")
    print("|---|---|---|---|---|")
    for n in (int(b) for b in args.bursts.split(",")):
        outs = burst(n)
        assert encode_lines(outs) == before_burst(outs) == encode_burst(outs)
        number = max(50, 20_000 // n)
        joined = us(lambda: before_burst(outs), number, args.repeats)  # noqa: B023
        lines = us(lambda: encode_lines(outs), number, args.repeats)  # noqa: B023
        channel = us(lambda: encode_burst(outs), number, args.repeats)  # noqa: B023
        print(f"| {n} | {joined:.1f} | {lines:.1f} | {channel:.1f} | {joined / channel:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
