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

Before anything is timed, the engine compiles a one-rule GBNF grammar: its vocabulary is built
(and, where GBNF converts in a child process, that child started), so the window holds the
large grammar's compile alone. The compile timed alone is of the same chain with another
literal, so no cache of the engine's or the converter's serves the measured one.

While the compile alone runs, a probe thread sleeps 1 ms in a loop: its wake-ups per second
(about 1,000 when nothing holds the GIL; a fifth of that when something does, each wake-up
waiting out the 5 ms switch interval) say whether the compile holds this process's GIL,
whatever the machine's other load does to the engine's steps.

The window is from the constrained request's arrival to its first token (its compile, as the
engine served it). Its longest gap and the plain requests' tokens per second in it are printed
beside the same figures after it (the same requests decoding with no compile: this run's own
control, the floor a busy machine sets). `max_gap_while_compiling_s` is the longest gap after
the arrival, window or not (the key earlier results used). Give the plain requests enough
`--tokens` to outlast the window, or the control is empty (null).

`--threads` sets torch's CPU threads, as `serve --threads` does (0: torch's default, one per
core). On a small machine running other work beside, torch's default makes every step wait for
its slowest thread, a floor of hundreds of milliseconds that hides what the compile adds;
`--threads 1` leaves a core to the rest.

    python benchmarks/engine/grammar_stall.py [--rules 1990] [--plain 8] [--tokens 64] [--threads 0]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pdserve.engine.offline import build_engine  # noqa: E402
from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.protocol.constraint import Constraint, ConstraintKind  # noqa: E402
from pdserve.protocol.outputs import RequestOutput  # noqa: E402
from pdserve.protocol.sampling import SamplingParams  # noqa: E402


def chain(rules: int, literal: str = "x") -> str:
    """A GBNF grammar: `root ::= r0`, `r0 ::= "x" r1`, ... each rule calling the next (its
    conversion to Lark, inside the compile, grows with the square of the chain)."""
    body = "".join(f'r{i} ::= "{literal}" r{i + 1}\n' for i in range(rules))
    return f'root ::= r0\n{body}r{rules} ::= "{literal}"\n'


def probed(fn: Callable[[], object]) -> tuple[float, float, float]:
    """(fn's seconds, a 1 ms sleeper thread's wake-ups per second and longest gap in ms) while
    `fn` runs on this thread."""
    wakes: list[float] = []
    stop = threading.Event()

    def sleeper() -> None:
        while not stop.is_set():
            time.sleep(0.001)
            wakes.append(time.perf_counter())

    thread = threading.Thread(target=sleeper, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    stop.set()
    thread.join()
    inside = [t0, *(t for t in wakes if t0 < t <= t1), t1]
    longest = max(b - a for a, b in zip(inside, inside[1:], strict=False))
    return t1 - t0, (len(inside) - 2) / (t1 - t0), longest * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rules", type=int, default=1990)
    ap.add_argument("--plain", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: its default)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    path = resolve_model("builtin:tiny")
    grammar = Constraint(kind=ConstraintKind.GRAMMAR, spec=chain(args.rules))
    twin = Constraint(kind=ConstraintKind.GRAMMAR, spec=chain(args.rules, "y"))

    eng = build_engine(path, device="cpu")
    eng.grammars.compiled(Constraint(kind=ConstraintKind.GRAMMAR, spec='root ::= "w"'))
    compile_s, wakes_per_s, probe_gap_ms = probed(lambda: eng.grammars.compiled(twin))

    stamps: dict[str, list[float]] = {f"p{i}": [] for i in range(args.plain)}
    ended: set[str] = set()
    first_constrained: list[float] = []

    def sink_of(rid: str):  # type: ignore[no-untyped-def]
        def sink(o: RequestOutput) -> None:
            if rid in stamps:
                stamps[rid].extend(time.perf_counter() for _ in o.token_ids)
            elif o.token_ids and not first_constrained:
                first_constrained.append(time.perf_counter())
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
    end = first_constrained[0] if first_constrained else time.perf_counter()
    last = max(s[-1] for s in stamps.values())

    def gaps(lo: float, hi: float) -> list[float]:
        """Gaps between two tokens of one plain request, the later in (lo, hi]."""
        pairs = (p for s in stamps.values() for p in zip(s, s[1:], strict=False))
        return [b - a for a, b in pairs if lo < b <= hi]

    def per_s(lo: float, hi: float) -> float | None:
        n = sum(lo < t <= hi for s in stamps.values() for t in s)
        return round(n / (hi - lo), 1) if n and hi > lo else None

    def longest(g: list[float]) -> float | None:
        return round(max(g), 3) if g else None

    after = gaps(asked, last)
    print(
        json.dumps(
            {
                "rules": args.rules,
                "compile_alone_s": round(compile_s, 3),
                "probe_wakeups_per_s_alone": round(wakes_per_s),
                "probe_max_gap_alone_ms": round(probe_gap_ms, 1),
                "plain_requests": args.plain,
                "torch_threads": torch.get_num_threads(),
                "max_gap_while_compiling_s": longest(after),
                "median_gap_s": round(sorted(after)[len(after) // 2], 4) if after else None,
                "window_s": round(end - asked, 3),
                "max_gap_in_window_s": longest(gaps(asked, end)),
                "max_gap_after_window_s": longest(gaps(end, last)),
                "plain_tok_per_s_in_window": per_s(asked, end),
                "plain_tok_per_s_after_window": per_s(end, last),
                "all_ended": len(ended) == args.plain + 1,
            }
        )
    )


if __name__ == "__main__":
    main()
