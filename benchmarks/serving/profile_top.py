"""The hottest functions of a py-spy profile (`py-spy record --format raw`, collapsed stacks):
by self samples and by inclusive samples, each as a share of all samples of the chosen threads.

    python benchmarks/serving/profile_top.py OUT/1p1d-c128-router.txt --top 25
    python benchmarks/serving/profile_top.py OUT/1p1d-c128-decode.txt --thread MainThread

gpu_serving.py --profile writes such files. A frame is `function (file:line)`; the line number
is dropped so that a function's samples add up.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_LINE = re.compile(r"^(.*) (\d+)$")
_FRAME_LINE = re.compile(r":\d+\)$")


def read(path: Path, thread: str) -> tuple[Counter[str], Counter[str], int]:
    """(self samples per function, inclusive samples per function, total samples)."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        m = _LINE.match(line.strip())
        if m is None:
            continue
        stack, n = m.group(1).split(";"), int(m.group(2))
        if thread and not any(thread in f for f in stack[:3]):
            continue
        frames = [_FRAME_LINE.sub(")", f) for f in stack if "(" in f]
        if not frames:
            continue
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    return own, incl, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--thread", default="", help="only stacks whose thread/process names this")
    args = ap.parse_args()
    own, incl, total = read(args.profile, args.thread)
    if not total:
        print("no samples")
        return 1
    print(f"{total} samples")
    for title, counts in (("self", own), ("inclusive", incl)):
        print(f"\n-- {title}")
        for frame, n in counts.most_common(args.top):
            print(f"{100 * n / total:6.1f}%  {frame[:150]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
