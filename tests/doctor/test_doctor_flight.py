"""`pdserve doctor --flight DIR`: where a failed tensor-parallel group's ranks parted, from the
flight recorders its ranks dumped (doctor/flight.py).

* Pure: the first step whose digests differ names that step and the rank that ran another
  plan; without one, the earliest failure that blames a rank; a rank that left no dump is named.
* Beside a --url that cannot be read (a stopped worker's): the dumps are still read, the URL a
  finding (exit 1); with no dump either, exit 3.
* A real `serve --tp 2 --flight-dir DIR` driven to a desync (fault point tp.recv.1=malformed)
  or with rank 1 SIGKILLed mid-request: the worker exits 1, and doctor, from DIR alone, names
  the step its error named and rank 1, with each rank's last records.

Every process is stopped by its pid (`ServerProcess`; the follower checked gone).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli import main
from pdserve.doctor.diagnosis import Diagnosis, Severity
from pdserve.doctor.flight import add_flights, parting
from pdserve.parallel.flight_recorder import (
    Flight,
    FlightDump,
    Group,
    new_group_dir,
    read_dir,
    write,
)
from pdserve.runtime.pids import wait_gone
from tests.procs import ServerProcess, http


def dump(rank: int, digests: list[int], ranks: tuple[int, ...] = (), at: float = 0.0,
         error: str = "boom") -> FlightDump:  # fmt: skip
    flights = tuple(Flight(s + 1, "FORWARD", d, 1, 1, 9, 50.0 + s) for s, d in enumerate(digests))
    step = len(digests)
    return FlightDump(rank, 2, 100 + rank, step, ranks, f"step {step}: {error}", 1e9 + at, 0.0,
                      flights)  # fmt: skip


def test_the_first_step_whose_digests_differ_is_where_the_ranks_parted():
    p = parting((dump(0, [1, 2, 3, 4], (1,)), dump(1, [1, 2, 9, 8], (1,))))
    assert p is not None and (p.step, p.ranks) == (3, (1,))
    assert p.how == "a plan digest differs: rank 0 ran FORWARD 0x00000003, rank 1's 0x00000009"
    no_leader = parting((dump(1, [1, 2]), dump(3, [1, 5])))  # rank 0 left none: the lowest's
    assert no_leader is not None and (no_leader.step, no_leader.ranks) == (2, (3,))


def test_without_a_differing_digest_the_failure_that_blames_a_rank_is_named():
    killed = dump(0, [1, 2, 3], (1,), at=2.0, error="rank 1 (pid 7) was killed by SIGKILL")
    vague = dump(1, [1, 2], (), at=1.0, error="could not exchange its head")
    p = parting((killed, vague))
    assert p is not None and (p.step, p.ranks) == (3, (1,))
    assert p.how == "rank 0 failed: step 3: rank 1 (pid 7) was killed by SIGKILL"
    only_vague = parting((vague,))
    assert only_vague is not None and (only_vague.step, only_vague.ranks) == (2, ())
    assert parting(()) is None


def test_doctor_s_words_for_a_group(tmp_path: Path):
    g = Group(
        tmp_path / "tp-100", (dump(0, [1, 2, 3], (1,), error="x" * 300),), ("rank-1.json: bad",)
    )
    d = Diagnosis(header="h")
    add_flights(d, tmp_path, [g], depth=2)
    assert [f.severity for f in d.findings] == [Severity.NOTE, Severity.DEGRADED, Severity.NOTE]
    assert d.findings[0].what == "unreadable dump rank-1.json: bad"
    assert d.findings[1].where == f"tensor-parallel worker (rank 0 pid 100; {g.directory})"
    assert d.findings[1].what.startswith("its 2 ranks parted at step 3 (rank 1): rank 0 failed")
    assert " ...; the group failed and its worker stopped" in d.findings[1].what  # cut short
    assert d.findings[2].what.startswith("rank 1 left no flight recorder")
    assert d.details[1].endswith("x" * 300)  # whole with the records
    assert [line.split()[0] for line in d.details[-3:]] == ["step", "2", "3"]
    assert d.details[-1].endswith("FORWARD 0x00000003 1s 1t          -  <- parted")
    assert d.code == 1
    empty = Diagnosis()
    add_flights(empty, tmp_path, [])
    assert empty.code == 0 and "no tensor-parallel group failed" in empty.findings[0].what


def written(flight: Path) -> Path:
    """A failed group's dumps, as its ranks write them: rank 1 ran another plan at step 3."""
    group = new_group_dir(flight, 100, 0.0)
    write(group, dump(0, [1, 2, 3], (1,)))
    write(group, dump(1, [1, 2, 9], (1,)))
    return group


def test_a_url_that_cannot_be_read_leaves_the_flight_recorders_read(tmp_path, capsys):
    flight = written(tmp_path / "flight")
    (tmp_path / "empty").mkdir()
    with socket.socket() as bound:  # bound, not listening: every connection is refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}"
        code = main(["doctor", "--url", url, "--flight", str(flight), "--timeout", "2"])
        out = capsys.readouterr().out
        assert code == 1, out  # the dumps' degraded and the URL's: not "nothing could be read"
        assert out.startswith(f"pdserve doctor: {url} and {flight}\n")
        assert f" ! {url}: cannot be read: " in out
        assert "its 2 ranks parted at step 3 (rank 1): a plan digest differs" in out
        assert out.splitlines()[-1].startswith(f"VERDICT: degraded: {url}: cannot be read")
        argv = ["doctor", "--url", url, "--flight", str(flight), "--timeout", "2", "--json"]
        assert main(argv) == 1
        doc = json.loads(capsys.readouterr().out)
        assert doc["error"].startswith(f"cannot read the cluster from {url}: ")
        assert [f["severity"] for f in doc["findings"]] == ["degraded", "degraded"]
        # No dump to read either: nothing could be read.
        assert main(["doctor", "--url", url, "--flight", str(tmp_path / "empty")]) == 3
        out = capsys.readouterr().out
        assert f"and no flight recorder under {tmp_path / 'empty'}" in out
        assert out.splitlines()[-1].startswith("VERDICT: unknown")


def test_doctor_without_a_source_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["doctor", "--json"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve doctor: error: give --url, --file or --flight")


# ---------------------------------------------------------------- a real worker


def doctor(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve", "doctor", *argv],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def serve_args(path: Path, flight: Path) -> list[str]:
    return ["serve", "--model", str(path), "--served-model-name", "tiny", "--tp", "2",
            "--threads", "1", "--kv-budget-mb", "16", "--max-model-len", "512",
            "--flight-dir", str(flight)]  # fmt: skip


def completion(url: str, max_tokens: int, got: list[Any]) -> None:
    body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "prompt": "a b c",
            "ignore_eos": True}  # fmt: skip
    got.append(http("POST", url + "/v1/completions", body))


@pytest.mark.process
@pytest.mark.parametrize("fault", ["desync", "rank-kill"])
def test_doctor_names_where_a_real_tp2_worker_s_ranks_parted(tiny_dir, tmp_path, fault):
    flight = tmp_path / "flight"
    env = {"PDSERVE_FAULTS": "tp.recv.1=malformed@0.3#1", "PDSERVE_FAULT_SEED": "1"}
    log = tmp_path / "serve.log"
    with ServerProcess(
        serve_args(tiny_dir, flight), log, env=env if fault == "desync" else {}
    ) as srv:
        pids = http("GET", srv.url + "/info")[1]["tp"]["pids"]
        got: list[Any] = []
        asking = threading.Thread(target=completion, args=(srv.url, 480, got), daemon=True)
        asking.start()
        if fault == "rank-kill":
            asking.join(1.0)  # mid-generation: 480 tokens take several seconds
            assert asking.is_alive(), got
            os.kill(pids[0], signal.SIGKILL)
        asking.join(30.0)
        assert not asking.is_alive(), "the request outlived its worker's failure"
        status, answer = got[0]
        assert status == 500, answer
        m = re.search(r"out of lockstep: step (\d+): .*\brank 1\b", str(answer))
        assert m is not None, answer
        step = int(m.group(1))
        assert srv.proc is not None and srv.proc.wait(20.0) == 1
        assert wait_gone(pids, 10.0) == []
    [group] = read_dir(flight)
    assert group.directory.parent == flight and group.directory.name.startswith(f"tp-{srv.pid}-")
    assert [d.rank for d in group.dumps] == ([0, 1] if fault == "desync" else [0])

    done = doctor("--flight", str(flight))
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert f"its 2 ranks parted at step {step} (rank 1): " in out, out
    assert out.splitlines()[-1].startswith("VERDICT: degraded: tensor-parallel worker (rank 0 pid")
    row = next(line for line in out.splitlines() if line.endswith("<- parted"))
    assert row.split()[0] == str(step)
    if fault == "desync":
        assert "a plan digest differs: rank 0 ran FORWARD" in out
        assert row.split()[2] != row.split()[6]  # rank 0's digest, rank 1's
    else:
        assert "rank 1 left no flight recorder" in out and "was killed by SIGKILL" in out
        assert row.split()[-3] == "-"  # no record of rank 1's
    for rank in (0, 1) if fault == "desync" else (0,):
        assert f"rank {rank} (pid " in out
    as_json = json.loads(doctor("--flight", str(flight), "--json").stdout)
    assert (
        as_json["code"] == 1 and as_json["details"][0] == f"flight recorders of {group.directory}:"
    )
