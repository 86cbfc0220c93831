"""What one slow grammar compile costs everyone else: the longest gap between the tokens of
requests without a grammar while a constrained request's grammar compiles (issue 45).

An engine (builtin tiny model, this process's thread) decodes `--plain` requests without a
grammar; once each has its first tokens, one request arrives whose constraint is a chain of
`--rules` GBNF rules (at most MAX_GBNF_RULES, 2,000; llguidance's converter takes about a
second for that many). The plain requests' longest gap between two tokens is printed,
with the compile's own time measured alone beforehand. An engine that compiles on its own
thread stalls every request for the whole compile; one that holds only the constrained
request keeps the others at their step time. The script uses only the engine's public calls,
so the same command runs on an older tree for the comparison.

    python benchmarks/engine/grammar_stall.py [--rules 1990] [--plain 8] [--tokens 64]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pdserve.engine.offline import build_engine  # noqa: E402
from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.protocol.constraint import Constraint, ConstraintKind  # noqa: E402
from pdserve.protocol.outputs import RequestOutput  # noqa: E402
from pdserve.protocol.sampling import SamplingParams  # noqa: E402


def chain(rules: int) -> str:
    """A GBNF grammar: `root ::= r0`, `r0 ::= "x" r1`, ... each rule calling the next (its
    conversion to Lark, inside the compile, grows with the square of the chain)."""
    body = "".join(f'r{i} ::= "x" r{i + 1}\n' for i in range(rules))
    return f'root ::= r0\n{body}r{rules} ::= "x"\n'


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rules", type=int, default=1990)
    ap.add_argument("--plain", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    path = resolve_model("builtin:tiny")
    grammar = Constraint(kind=ConstraintKind.GRAMMAR, spec=chain(args.rules))

    alone = build_engine(path, device="cpu")
    t0 = time.perf_counter()
    alone.grammars.compiled(grammar)
    compile_s = time.perf_counter() - t0

    eng = build_engine(path, device="cpu")
    stamps: dict[str, list[float]] = {f"p{i}": [] for i in range(args.plain)}
    ended: set[str] = set()

    def sink_of(rid: str):  # type: ignore[no-untyped-def]
        def sink(o: RequestOutput) -> None:
            if rid in stamps:
                stamps[rid].extend(time.perf_counter() for _ in o.token_ids)
            if o.finish_reason is not None:
                ended.add(rid)

        return sink

    plain = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    for i in range(args.plain):
        eng.submit(f"p{i}", [1 + i, 2, 3, 4], plain, sink_of(f"p{i}"))
    while min(len(s) for s in stamps.values()) < 4:
        eng.tick()
    asked = time.perf_counter()
    constrained = SamplingParams(max_tokens=4, temperature=0, constraint=grammar)
    eng.submit("g", [5, 6, 7], constrained, sink_of("g"))
    deadline = time.monotonic() + 120
    while len(ended) < args.plain + 1 and time.monotonic() < deadline:
        eng.tick()
    gaps = [b - a for s in stamps.values() for a, b in zip(s, s[1:], strict=False) if b > asked]
    print(
        json.dumps(
            {
                "rules": args.rules,
                "compile_alone_s": round(compile_s, 3),
                "plain_requests": args.plain,
                "max_gap_while_compiling_s": round(max(gaps), 3) if gaps else None,
                "median_gap_s": round(sorted(gaps)[len(gaps) // 2], 4) if gaps else None,
                "all_ended": len(ended) == args.plain + 1,
            }
        )
    )


if __name__ == "__main__":
    main()
