"""The worker's cost to parse and check one /generate body, by prompt length.

    python benchmarks/generate_body.py [--prompts 16,256,2048,8192] [--repeats 5]

A router's /generate body (request id, prompt ids, params, timeout, channel) is parsed on the
worker's event loop, which shares the GIL with the engine thread: every µs here is a µs the
engine cannot run. Side by side in one run: the general decoder (every JSON endpoint's
`parse_json_body`, then the field checks, per prompt id in Python: the only path before
2026-12-05) and `parse_generate` now (msgspec into a typed struct, then the same checks;
worker/http/generate_body.py). Both end in the engine's own `validate_prompt`. Median µs per body
of --repeats.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.microbench import us  # noqa: E402
from pdserve.protocol.sampling import SamplingParams, validate_prompt  # noqa: E402
from pdserve.server.json_body import parse_json_body  # noqa: E402
from pdserve.worker.http import generate_body  # noqa: E402

VOCAB, MAX_LEN = 128_256, 32_768


def validate(prompt_ids: list[int], params: SamplingParams) -> None:
    validate_prompt(prompt_ids, params, VOCAB, MAX_LEN)


def raw_body(n: int) -> bytes:
    """What the router sends (router/backend.py generate_body), for an n-token prompt."""
    params = SamplingParams(max_tokens=128, temperature=0.7, top_p=0.9, seed=7).to_builtins()
    prompt = [(i * 7919) % VOCAB for i in range(n)]
    body = {"request_id": "cmpl-0123456789abcdef-0", "prompt_ids": prompt, "params": params,
            "timeout_s": 600.0, "channel": "router-3f2a"}  # fmt: skip
    return json.dumps(body).encode()


def general(raw: bytes) -> generate_body.Generate:
    return generate_body._general(parse_json_body(raw, None), validate)


def now(raw: bytes) -> generate_body.Generate:
    return generate_body.parse_generate(raw, None, validate)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default="16,256,2048,8192")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print("| prompt tokens | body bytes | general µs | parse_generate µs | general / now |")
    print("|---|---|---|---|---|")
    for n in (int(p) for p in args.prompts.split(",")):
        raw = raw_body(n)
        assert generate_body._fast(raw, None, validate) == general(raw) == now(raw)
        number = max(20, 100_000 // n)
        before = us(lambda: general(raw), number, args.repeats)  # noqa: B023
        after = us(lambda: now(raw), number, args.repeats)  # noqa: B023
        print(f"| {n} | {len(raw)} | {before:.1f} | {after:.1f} | {before / after:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
