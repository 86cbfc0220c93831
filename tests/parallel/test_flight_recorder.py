"""The flight recorder's dump (parallel/flight_recorder.py) and when a rank writes it
(Lockstep.fail): one form on disk, read back exactly, anything else refused; a directory of its
own per group; the first failure is dumped, and replaced only by a later one that names the
rank the first could not; after a failure the leader stops a follower only once its dump is
there, or after DUMP_WAIT_S (TpLeader.close)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pdserve.engine import tp_leader
from pdserve.engine.tp_leader import TpLeader
from pdserve.parallel import flight_recorder
from pdserve.parallel.flight_recorder import (
    DumpError,
    Flight,
    FlightDump,
    group_dir,
    new_group_dir,
    read_dir,
)
from pdserve.parallel.lockstep import Lockstep, LockstepError
from pdserve.parallel.step_record import Kind, StepRecord


def dump(rank: int, step: int = 7, ranks: tuple[int, ...] = (1,), at: float = 100.0) -> FlightDump:
    flights = tuple(Flight(s, "FORWARD", 0x1000 + s, 2, 3, 40, at + s) for s in range(1, step + 1))
    return FlightDump(rank, 2, 4000 + rank, step, ranks, f"step {step}: boom", 1e9 + step, 5.0,
                      flights)  # fmt: skip


def test_a_dump_reads_back_as_written(tmp_path: Path):
    d = dump(1)
    path = flight_recorder.write(tmp_path / "g", d)
    assert path == tmp_path / "g" / "rank-1.json"
    assert FlightDump.from_json(json.loads(path.read_text())) == d
    assert d.unix(d.flights[0]) == 101.0 + 5.0
    assert list((tmp_path / "g").iterdir()) == [path]  # no temporary left beside it


RECORD = dump(0).to_json()["flights"][0]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"version": 2}, "not a version 1 flight dump"),
        ({"rank": 2}, "rank 2 of a group of 2"),
        ({"rank": -1}, "rank -1 of a group of 2"),
        ({"world": 1}, r"a group of 1 ranks \(a dump's group has 2\.\.1024\)"),
        ({"world": 1025}, "a group of 1025 ranks"),
        ({"step": "seven"}, "missing or mistyped: step 'seven' \\(not int\\)"),
        ({"step": "7"}, "missing or mistyped: step '7'"),  # not read as 7
        ({"step": 7.0}, "missing or mistyped: step 7.0"),  # an int is no float
        ({"world": True}, "missing or mistyped: world True"),  # nor a bool
        ({"rank": False}, "missing or mistyped: rank False"),
        ({"pid": None}, "missing or mistyped: pid None"),
        ({"error": 5}, "missing or mistyped: error 5 \\(not str\\)"),
        ({"failed_unix": "1e9"}, "missing or mistyped: failed_unix '1e9' \\(not float\\)"),
        ({"clock_offset_s": True}, "missing or mistyped: clock_offset_s True"),
        ({"flights": [{"step": 1}]}, "missing or mistyped: kind None"),
        ({"flights": [{**RECORD, "digest": 1.5}]}, "missing or mistyped: digest 1.5"),
        ({"flights": [{**RECORD, "seqs": True}]}, "missing or mistyped: seqs True"),
        ({"flights": [{**RECORD, "at": "now"}]}, "missing or mistyped: at 'now'"),
        ({"flights": [7]}, "missing or mistyped: a record 7"),
        ({"flights": {"step": 1}}, "missing or mistyped: flights"),
        ({"ranks": None}, "missing or mistyped: ranks None"),
        ({"ranks": "1"}, "missing or mistyped: ranks '1'"),  # not a list of one rank
        ({"ranks": [2]}, r"missing or mistyped: ranks \[2\] \(a list of ranks of a group of 2\)"),
        ({"ranks": [-1]}, r"ranks \[-1\]"),
        ({"ranks": [True]}, r"ranks \[True\]"),
        ({"ranks": [1.0]}, r"ranks \[1\.0\]"),
    ],
)
def test_what_is_not_a_dump_is_refused(change: dict[str, Any], why: str):
    with pytest.raises(DumpError, match=why):
        FlightDump.from_json({**dump(0).to_json(), **change})
    with pytest.raises(DumpError, match="not a version 1"):
        FlightDump.from_json([1, 2])
    missing = dump(0).to_json()
    del missing["pid"]
    with pytest.raises(DumpError, match="missing or mistyped: pid None"):
        FlightDump.from_json(missing)


def test_a_dump_of_any_group_size_in_bounds_and_a_float_written_as_an_int_read_back():
    doc = {**dump(1).to_json(), "world": 1024, "ranks": [0, 1023], "failed_unix": 1000000000}
    doc["flights"] = [{**RECORD, "at": 51}]
    d = FlightDump.from_json(doc)
    assert (d.world, d.ranks, d.failed_unix, d.flights[0].at) == (1024, (0, 1023), 1e9, 51.0)
    assert isinstance(d.failed_unix, float) and isinstance(d.flights[0].at, float)


def test_a_flight_directory_holds_a_group_per_leader(tmp_path: Path):
    older, newer = group_dir(tmp_path, 11, 0.0), group_dir(tmp_path, 11, 86400.5)
    assert older == tmp_path / "tp-11-19700101T000000Z"  # the same pid, started again: apart
    assert newer == tmp_path / "tp-11-19700102T000000Z"
    flight_recorder.write(newer, dump(0, step=9))
    flight_recorder.write(older, dump(0, step=3))
    flight_recorder.write(older, dump(1, step=3))
    (newer / "rank-1.json").write_text("{not json")
    (tmp_path / "notes").mkdir()  # not a group: passed over
    groups = read_dir(tmp_path)
    assert [g.directory for g in groups] == [older, newer]  # oldest failure first
    assert [d.rank for d in groups[0].dumps] == [0, 1] and groups[0].unreadable == ()
    assert [d.rank for d in groups[1].dumps] == [0]
    assert groups[1].unreadable[0].startswith("rank-1.json: ")
    assert [g.directory for g in read_dir(older)] == [older]  # a group's own directory
    assert read_dir(tmp_path / "nothing") == []


def test_each_group_makes_a_directory_of_its_own(tmp_path: Path):
    flight = tmp_path / "flight"  # made as the first group starts
    first = new_group_dir(flight, 11, 0.0)
    again = new_group_dir(flight, 11, 0.5)  # the same pid within the same second
    assert first == tmp_path / "flight" / "tp-11-19700101T000000Z"
    assert again == tmp_path / "flight" / "tp-11-19700101T000000Z-2"
    assert new_group_dir(flight, 11, 0.9).name == "tp-11-19700101T000000Z-3"
    assert new_group_dir(flight, 12, 0.0).name == "tp-12-19700101T000000Z"
    assert all(d.is_dir() for d in (first, again))
    flight_recorder.write(again, dump(0))
    assert [g.directory for g in read_dir(flight)] == [again]  # a group that did not fail: none
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        new_group_dir(tmp_path / "file", 11, 0.0)


def leader(tmp_path: Path) -> Lockstep:
    group: Any = SimpleNamespace(rank=0, world_size=2)  # what fail() reads of a RankGroup
    ls = Lockstep(group, torch.device("cpu"), dump_dir=tmp_path)
    for step in (1, 2):
        ls.step = step
        ls._note(StepRecord(Kind.IDLE, step), 0xAB + step, 8)
    return ls


def read(tmp_path: Path) -> FlightDump:
    return FlightDump.from_json(json.loads((tmp_path / "rank-0.json").read_text()))


def test_the_first_failure_is_dumped_and_only_a_naming_one_replaces_it(tmp_path: Path):
    ls = leader(tmp_path)
    first = ls.fail("step 2: rank 0 could not exchange its head")
    assert ls.failed is first and read(tmp_path).ranks == ()
    assert [f.step for f in read(tmp_path).flights] == [1, 2]
    named = ls.fail("step 2: rank 1 (pid 9) was killed by SIGKILL", [1])
    assert ls.failed is named and read(tmp_path).ranks == (1,)
    assert read(tmp_path).error == "step 2: rank 1 (pid 9) was killed by SIGKILL"
    ls.fail("step 2: something later", [1])  # the named failure stays
    assert ls.failed is named and read(tmp_path).error.endswith("SIGKILL")


def test_a_rank_without_a_flight_directory_writes_nothing(tmp_path: Path):
    ls = leader(tmp_path)
    ls.dump_dir = None
    ls.fail("step 2: boom", [1])
    assert list(tmp_path.iterdir()) == []


def test_a_dump_that_cannot_be_written_leaves_the_failure_as_it_was(tmp_path: Path):
    (tmp_path / "file").write_text("")
    ls = leader(tmp_path / "file" / "below")  # not a directory: OSError, logged
    error = ls.fail("step 2: boom", [1])
    assert ls.failed is error and error.ranks == (1,)


class Rank:
    """A follower as TpLeader.close sees it: alive until stopped; whether its dump was there."""

    def __init__(self, rank: int, directory: Path) -> None:
        self.rank, self.directory = rank, directory
        self.proc = SimpleNamespace(wait=self._wait)
        self.dump_at_stop: bool | None = None

    def _wait(self, timeout: float) -> int:
        time.sleep(timeout)
        raise subprocess.TimeoutExpired("rank", timeout)

    def exited(self) -> str | None:
        return None

    def stop(self, wait_s: float) -> None:
        self.dump_at_stop = flight_recorder.dump_path(self.directory, self.rank).exists()


def failed_leader(tmp_path: Path) -> tuple[TpLeader, Rank]:
    lockstep: Any = SimpleNamespace(
        failed=LockstepError("step 3: the plan digests differ", 3, [1]),
        dump_dir=tmp_path,
        device=torch.device("cpu"),
    )
    group: Any = SimpleNamespace(timeout_s=30.0, close=lambda: None)
    follower = Rank(1, tmp_path)
    return TpLeader(group, lockstep, [follower]), follower  # type: ignore[list-item]


def test_after_a_failure_a_follower_is_stopped_once_its_dump_is_there(tmp_path: Path):
    leader, follower = failed_leader(tmp_path)
    late = threading.Timer(0.3, flight_recorder.write, (tmp_path, dump(1)))  # a slow rank 1
    late.start()
    t0 = time.monotonic()
    try:
        leader.close()
    finally:
        late.join(10.0)
    assert follower.dump_at_stop is True
    assert 0.3 <= time.monotonic() - t0 < tp_leader.DUMP_WAIT_S


def test_a_follower_that_writes_no_dump_is_stopped_after_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(tp_leader, "DUMP_WAIT_S", 0.3)
    leader, follower = failed_leader(tmp_path)
    t0 = time.monotonic()
    leader.close()
    assert follower.dump_at_stop is False
    assert 0.3 <= time.monotonic() - t0 < 0.3 + 2.0
