"""The flight recorder of a tensor-parallel rank: its last step records, and their dump.

Each rank keeps the last FLIGHT_DEPTH records it sent or received (`Flight`: step, kind, the
digest it computed, sizes, when) in a ring buffer (parallel/lockstep.py). When the group fails,
the rank writes the ring to its log and, given a flight directory (`serve --flight-dir`), to
`<group dir>/rank-<r>.json` (`FlightDump`), so that the record outlives the worker, which
stops right after: `pdserve doctor --flight DIR` reads the dumps of every rank side by side
and names the step where the ranks parted (doctor/flight.py).

A group's directory is `<flight dir>/tp-<leader pid>-<its start, UTC>` (`group_dir`), made by
the leader as it starts (`new_group_dir`) and its group's alone: every worker of a launch may
share one flight directory, and a name already taken (another group of the same process started
in the same second, or a pid the system handed out again within it) gets a suffix, `-2`, `-3`.
The leader names the directory on each follower's command line; nothing read from a socket
names a path (LESSONS #15).

One form on disk (STYLE 14): `FlightDump.to_json` is its only writer and `from_json` its only
reader, which refuses what it cannot read (`DumpError`) rather than guessing: every field of
its type (an int is no bool and no float), a group of 2..MAX_WORLD ranks, every rank in it. A
rank SIGKILLed leaves no dump: the others' say which rank went silent. Pure but for
`new_group_dir`, `write` and `read_dir`; no torch here, so doctor reads dumps without it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FLIGHT_DEPTH = 64
VERSION = 1
GROUP_PREFIX = "tp-"
MAX_WORLD = 1024  # a dump of a larger group is not one of ours (--tp is at most config.MAX_TP)
MAX_GROUP_NAMES = 100  # new_group_dir's tries for one leader pid and second
MISTYPED = "a flight dump's field is missing or mistyped"


class DumpError(ValueError):
    """A file that is not a flight dump of this version: the message says why."""


@dataclass(frozen=True)
class Flight:
    """One record as this rank saw it."""

    step: int
    kind: str
    digest: int
    seqs: int
    tokens: int
    words: int
    at: float  # time.monotonic() when it was sent or received (one clock for every rank)

    def __str__(self) -> str:
        return (
            f"step {self.step} {self.kind} digest {self.digest:#010x} seqs {self.seqs} "
            f"tokens {self.tokens} words {self.words} at {self.at:.3f}"
        )


@dataclass(frozen=True)
class FlightDump:
    """What one rank wrote when its group failed."""

    rank: int
    world: int
    pid: int
    step: int  # the step it failed at (LockstepError.step)
    ranks: tuple[int, ...]  # the ranks its error blames (none: it could not tell)
    error: str
    failed_unix: float  # wall clock when it failed
    clock_offset_s: float  # time.time() - time.monotonic() then: a Flight's `at` as wall clock
    flights: tuple[Flight, ...]  # oldest first

    def unix(self, flight: Flight) -> float:
        """When `flight` was, by the wall clock."""
        return flight.at + self.clock_offset_s

    def to_json(self) -> dict[str, Any]:
        flights = [asdict(f) for f in self.flights]
        return {"version": VERSION, **asdict(self), "ranks": list(self.ranks), "flights": flights}

    @classmethod
    def from_json(cls, doc: Any) -> FlightDump:
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
            raise DumpError(f"not a version {VERSION} flight dump")
        fields = _typed(doc, _DUMP_TYPES)
        world, rank = fields["world"], fields["rank"]
        if not 2 <= world <= MAX_WORLD:
            raise DumpError(f"a group of {world} ranks (a dump's group has 2..{MAX_WORLD})")
        if not 0 <= rank < world:
            raise DumpError(f"rank {rank} of a group of {world}")
        ranks, flights = doc.get("ranks"), doc.get("flights")
        if not isinstance(ranks, list) or not all(_is_int(r) and 0 <= r < world for r in ranks):
            raise DumpError(
                f"{MISTYPED}: ranks {_shown(ranks)} (a list of ranks of a group of {world})"
            )
        if not isinstance(flights, list):
            raise DumpError(f"{MISTYPED}: flights {_shown(flights)} (a list of records)")
        records = tuple(Flight(**_typed(f, _FLIGHT_TYPES)) for f in flights)
        return cls(**fields, ranks=tuple(ranks), flights=records)


_FLIGHT_TYPES = {"step": int, "kind": str, "digest": int, "seqs": int, "tokens": int,
                 "words": int, "at": float}  # fmt: skip
_DUMP_TYPES = {"rank": int, "world": int, "pid": int, "step": int, "error": str,
               "failed_unix": float, "clock_offset_s": float}  # fmt: skip


def _shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + " ..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON's true is no rank


def _typed(doc: Any, types: dict[str, type]) -> dict[str, Any]:
    """`doc`'s fields named in `types`, each of its type exactly (a float may be written as
    an int: 5 for 5.0); DumpError for one missing or of another type."""
    if not isinstance(doc, dict):
        raise DumpError(f"{MISTYPED}: a record {_shown(doc)}")
    out = {}
    for name, kind in types.items():
        value: Any = doc.get(name)
        if kind is float and (_is_int(value) or isinstance(value, float)):
            value = float(value)
        if not (_is_int(value) if kind is int else isinstance(value, kind)):
            raise DumpError(f"{MISTYPED}: {name} {_shown(value)} (not {kind.__name__})")
        out[name] = value
    return out


def dump_of(
    rank: int, world: int, step: int, ranks: Sequence[int], error: str, flights: Sequence[Flight]
) -> FlightDump:
    """This process's dump, as it fails now."""
    now = time.time()
    return FlightDump(rank, world, os.getpid(), step, tuple(ranks), error, now,
                      now - time.monotonic(), tuple(flights))  # fmt: skip


def group_dir(flight_dir: Path, leader_pid: int, started_unix: float, nth: int = 1) -> Path:
    """The `nth` name for the directory of the group led by `leader_pid`, started then."""
    when = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started_unix))
    return flight_dir / f"{GROUP_PREFIX}{leader_pid}-{when}{f'-{nth}' if nth > 1 else ''}"


def new_group_dir(flight_dir: Path, leader_pid: int, started_unix: float) -> Path:
    """This group's directory, made now (exclusively: the first of `group_dir`'s names no
    other group has taken), where its ranks write their dumps. OSError if none can be made."""
    flight_dir.mkdir(parents=True, exist_ok=True)
    for nth in range(1, MAX_GROUP_NAMES + 1):
        directory = group_dir(flight_dir, leader_pid, started_unix, nth)
        try:
            directory.mkdir()
        except FileExistsError:
            continue
        return directory
    raise FileExistsError(
        f"{MAX_GROUP_NAMES} groups of pid {leader_pid} in one second under {flight_dir}"
    )


def dump_path(directory: Path, rank: int) -> Path:
    """Where rank `rank` of the group whose directory this is writes its dump."""
    return directory / f"rank-{rank}.json"


def write(directory: Path, dump: FlightDump) -> Path:
    """`directory/rank-<r>.json`, whole or not at all (a rename over a temporary name)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = dump_path(directory, dump.rank)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dump.to_json(), indent=1))
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class Group:
    """The dumps one failed group left in its directory, by rank; files that could not be read."""

    directory: Path
    dumps: tuple[FlightDump, ...]
    unreadable: tuple[str, ...]  # "rank-1.json: why"


def read_dir(directory: Path) -> list[Group]:
    """Every group under `directory`: the directory itself if it holds rank dumps, else each
    `tp-*` directory in it that does; oldest failure first."""
    candidates = [directory] if any(directory.glob("rank-*.json")) else sorted(
        p for p in directory.glob(f"{GROUP_PREFIX}*") if p.is_dir()
    )  # fmt: skip
    groups = []
    for d in candidates:
        dumps, bad = [], []
        for path in sorted(d.glob("rank-*.json")):
            try:
                dumps.append(FlightDump.from_json(json.loads(path.read_text())))
            except (OSError, ValueError) as e:  # DumpError and JSONDecodeError are ValueErrors
                bad.append(f"{path.name}: {e}")
        if dumps or bad:
            groups.append(Group(d, tuple(sorted(dumps, key=lambda x: x.rank)), tuple(bad)))
    return sorted(groups, key=lambda g: min((x.failed_unix for x in g.dumps), default=0.0))
