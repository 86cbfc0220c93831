"""The worker's cost to read and check one /generate body, by prompt length.

    python benchmarks/codec/generate_body.py [--prompts 16,256,2048,8192] [--repeats 5]

A router's /generate body (request id, prompt ids, params, timeout, channel) is read on the
worker's event loop, which shares the GIL with the engine thread: every µs here is a µs the
engine cannot run. Timed: the router's writing of it (`encode_generate`), the worker's one
decoder (`utf8_body`, then `decode_generate`: msgspec's typed decoding and the checks no type
states; protocol/generate.py), and that decoder followed by the engine's own check
(`validate_prompt`, which `engine.submit` runs): what /generate costs the loop before the
engine has the request. Median µs per body of --repeats.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.codec.microbench import us  # noqa: E402
from pdserve.protocol.generate import Generate, decode_generate, encode_generate  # noqa: E402
from pdserve.protocol.sampling import SamplingParams, validate_prompt  # noqa: E402
from pdserve.server.json_body import utf8_body  # noqa: E402

VOCAB, MAX_LEN = 128_256, 32_768


def body(n: int) -> Generate:
    """What the router sends (router/backend.py generate_body, on a channel), for an n-token
    prompt."""
    params = SamplingParams(max_tokens=128, temperature=0.7, top_p=0.9, seed=7)
    prompt = [(i * 7919) % VOCAB for i in range(n)]
    return Generate(request_id="cmpl-0123456789abcdef-0", prompt_ids=prompt, params=params,
                    timeout_s=600.0, channel="router-3f2a")  # fmt: skip


def read(raw: bytes) -> Generate:
    return decode_generate(utf8_body(raw, None))


def read_and_validate(raw: bytes) -> Generate:
    g = read(raw)
    validate_prompt(g.prompt_ids, g.params, VOCAB, MAX_LEN)
    return g


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default="16,256,2048,8192")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print("| prompt tokens | body bytes | encode µs | decode µs | decode + validate_prompt µs |")
    print("|---|---|---|---|---|")
    for n in (int(p) for p in args.prompts.split(",")):
        g = body(n)
        raw = encode_generate(g)
        assert read_and_validate(raw) == g
        number = max(20, 100_000 // n)
        enc = us(lambda: encode_generate(g), number, args.repeats)  # noqa: B023
        dec = us(lambda: read(raw), number, args.repeats)  # noqa: B023
        both = us(lambda: read_and_validate(raw), number, args.repeats)  # noqa: B023
        print(f"| {n} | {len(raw)} | {enc:.1f} | {dec:.1f} | {both:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
