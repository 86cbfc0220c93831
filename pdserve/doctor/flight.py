"""Doctor's reading of tensor-parallel flight recorders: where the ranks of a failed group parted.

`pdserve doctor --flight DIR` reads the dumps every rank of a failed group wrote
(parallel/flight_recorder.py: `DIR/tp-<leader pid>-<start>/rank-<r>.json`, or DIR itself), alone or
beside a router's or a server's document (--url): a worker whose ranks failed has stopped, so
its own /debug/state is gone, and the dumps are what is left of it. For each group:

* **The parting**, the first step the ranks did not run alike: the first step whose digest
  differs between two ranks that both recorded it (a rank ran another plan: it and the step
  are named, against rank 0's digest, or the lowest rank's when rank 0 left no dump); else the
  failure the dumps name, the earliest that blames a rank (one that died, or could not read
  the record), else the earliest (a collective past its bound, naming nobody).
* A rank that left no dump is named: a rank killed by a signal writes none.
* Each rank's failure, and its last records side by side, a row per step.

A failed group is DEGRADED (diagnosis.py): its worker stopped, and whether others serve is
for the router's document to say. Pure: no I/O, no clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.doctor.diagnosis import Diagnosis, Severity
from pdserve.parallel.flight_recorder import GROUP_PREFIX, Flight, FlightDump, Group

DEPTH = 8  # the last records shown per rank
CELL = 34  # a rank's column in the table


@dataclass(frozen=True)
class Parting:
    """Where the ranks parted: the step, the ranks at fault (none: unknown), in words."""

    step: int
    ranks: tuple[int, ...]
    how: str


def parting(dumps: tuple[FlightDump, ...]) -> Parting | None:
    """The first step the ranks did not run alike (module docstring); None without dumps."""
    if not dumps:
        return None
    steps = {d.rank: {f.step: f for f in d.flights} for d in dumps}
    ref = next((d for d in dumps if d.rank == 0), dumps[0])
    for step in sorted(steps[ref.rank]):
        mine = steps[ref.rank][step]
        bad = [
            d.rank
            for d in dumps
            if d.rank != ref.rank and step in steps[d.rank]
            and steps[d.rank][step].digest != mine.digest
        ]  # fmt: skip
        if bad:
            told = ", ".join(f"rank {r}'s {steps[r][step].digest:#010x}" for r in bad)
            how = (
                f"a plan digest differs: rank {ref.rank} ran {mine.kind} {mine.digest:#010x}, "
                f"{told}"
            )
            return Parting(step, tuple(bad), how)
    blaming = [d for d in dumps if d.ranks]
    first = min(blaming or list(dumps), key=lambda d: d.failed_unix)
    return Parting(first.step, first.ranks, f"rank {first.rank} failed: {_short(first.error)}")


def add_flights(d: Diagnosis, source: Path, groups: list[Group], depth: int = DEPTH) -> None:
    """Findings and records for every failed group read under `source`."""
    if not groups:
        d.add(Severity.NOTE, f"flight directory {source}", "no tensor-parallel group failed "
              "here (no rank-*.json dumps)")  # fmt: skip
        return
    for g in groups:
        where = _name(g)
        for bad in g.unreadable:
            d.add(Severity.NOTE, where, f"unreadable dump {bad}")
        p = parting(g.dumps)
        if p is None:
            continue
        world = max(x.world for x in g.dumps)
        at = ", ".join(f"rank {r}" for r in p.ranks) or "no rank named"
        d.add(
            Severity.DEGRADED,
            where,
            f"its {world} ranks parted at step {p.step} ({at}): {p.how}; the group failed and "
            "its worker stopped",
        )
        have = {x.rank for x in g.dumps}
        for r in sorted(set(range(world)) - have):
            d.add(Severity.NOTE, where, f"rank {r} left no flight recorder (a rank killed by "
                  "a signal writes none)")  # fmt: skip
        d.details += _records(g, p, world, depth)


def _name(g: Group) -> str:
    leader = next((x for x in g.dumps if x.rank == 0), None)
    pid = str(leader.pid) if leader else g.directory.name.removeprefix(GROUP_PREFIX).split("-")[0]
    return f"tensor-parallel worker (rank 0 pid {pid}; {g.directory})"


def _records(g: Group, p: Parting, world: int, depth: int) -> list[str]:
    """Each rank's failure, then its last `depth` records side by side."""
    out = [f"flight recorders of {g.directory}:"]
    for x in g.dumps:
        out.append(f"  rank {x.rank} (pid {x.pid}) failed at {_clock(x.failed_unix)}, "
                   f"step {x.step}: {x.error}")  # fmt: skip
    by_rank = {x.rank: {f.step: f for f in x.flights} for x in g.dumps}
    steps = sorted({s for rows in by_rank.values() for s in rows})[-depth:]
    head = "".join(f"{f'rank {r}':<{CELL}}" for r in range(world))
    out.append(f"  {'step':>6}  {head.rstrip()}")
    for s in steps:
        cells = "".join(f"{_cell(by_rank.get(r, {}).get(s)):<{CELL}}" for r in range(world))
        mark = "  <- parted" if s == p.step else ""
        out.append(f"  {s:>6}  {cells.rstrip()}{mark}")
    return out


def _short(error: str, limit: int = 200) -> str:
    """An error's first words (a collective's cause can run long: shown whole with the
    records)."""
    return error if len(error) <= limit else error[:limit] + " ..."


def _cell(f: Flight | None) -> str:
    if f is None:
        return "-"
    return f"{f.kind} {f.digest:#010x} {f.seqs}s {f.tokens}t"


def _clock(unix: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix)) + f".{int(unix % 1 * 1000):03d}"
