"""The prefix cache's eviction step on the engine thread: `Lease.drop` of a few pages from the
cache's lease, which holds every cached page (kvcache/lease.py).

    python benchmarks/engine/lease_drop.py [--pages 4096,32768] [--drops 1000] [--per-drop 2]

Opens one lease on the whole pool (a full cache), drops --per-drop pages at a time in a
shuffled order and prints the mean µs per drop at each pool size.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pdserve.kvcache.allocator import PageAllocator  # noqa: E402
from pdserve.kvcache.lease import Leases  # noqa: E402


def us_per_drop(pages: int, drops: int, per_drop: int) -> float:
    cache = Leases(PageAllocator(pages)).open("prefix cache", pages)
    order = list(cache.pages)
    random.Random(0).shuffle(order)
    t0 = time.perf_counter()
    for i in range(drops):
        cache.drop(order[i * per_drop : (i + 1) * per_drop])
    return (time.perf_counter() - t0) / drops * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", default="4096,32768")
    ap.add_argument("--drops", type=int, default=1000)
    ap.add_argument("--per-drop", type=int, default=2)
    args = ap.parse_args()
    for n in (int(x) for x in args.pages.split(",")):
        if args.drops * args.per_drop > n:
            raise SystemExit(f"--drops x --per-drop exceeds {n} pages")
        print(f"{n} pages cached: {us_per_drop(n, args.drops, args.per_drop):.1f} us a drop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
