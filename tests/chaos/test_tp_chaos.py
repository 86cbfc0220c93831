"""`pdserve chaos --scenario tp-desync` and `tp-rank-kill`, one round each (chaos/tp.py).

A cluster of a `--tp 2` worker and a TP-1 one behind the router; rank 1 of the TP worker reads
another plan, or is SIGKILLed, under load. The run passes (exit 0) and its report shows the
failure named within 5 s, the worker gone with its ranks, the survivor serving and quiet, and
the flight recorders naming rank 1 at the step the requests' errors named.

The chaos run starts and stops its own cluster; this test still owns every process of it:
whatever happens, it SIGKILLs by pid what is left (the cluster's processes from
composed.json, the rank processes that name a worker of it as their parent, the chaos client
from its progress file), each only while its command line names a path under this test's work
directory (a key file, the flight directory, the progress file): a pid the run's processes
freed may be another test's process by now.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.chaos.tp import is_rank_of
from pdserve.runtime.pids import cmdline, signal_pdserve, wait_gone

pytestmark = pytest.mark.process


def started_pids(work: Path) -> list[int]:
    pids = []
    for table in work.glob("cluster-*/composed.json"):
        pids += [p["pid"] for p in json.loads(table.read_text())["processes"]]
    pids += followers_of(pids)
    for progress in work.glob("*.json"):
        try:
            pids.append(json.loads(progress.read_text())["pid"])
        except (ValueError, KeyError, TypeError):
            pass
    return pids


def followers_of(workers: list[int]) -> list[int]:
    """The tensor-parallel ranks started by these workers (`--parent PID` on their command line:
    a rank's parent may have died and left it to init)."""
    procs = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [pid for pid in procs if any(is_rank_of(cmdline(pid), w) for w in workers)]


def under(work: Path) -> Callable[[list[str]], bool]:
    """A test of a command line: does it name a path under `work` (this run's own)?"""
    roots = {f"{work}{os.sep}", f"{work.resolve()}{os.sep}"}
    return lambda argv: any(a.startswith(root) for a in argv for root in roots)


def kill_leftovers(work: Path) -> list[int]:
    ours = under(work)
    left = [p for p in started_pids(work) if signal_pdserve(p, signal.SIGKILL, ours)]
    wait_gone(left, 10.0)
    return left


@pytest.mark.parametrize("scenario", ["tp-desync", "tp-rank-kill"])
def test_a_tp_worker_s_ranks_part_and_the_cluster_serves_on(tiny_dir, tmp_path, scenario):
    report, work = tmp_path / "chaos.json", tmp_path / "work"
    argv = [sys.executable, "-m", "pdserve", "chaos", "--scenario", scenario, "--rounds", "1",
            "--sessions", "8", "--kill-after", "1:2", "--model", str(tiny_dir),
            "--report", str(report), "--work-dir", str(work)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        left = kill_leftovers(work)
    assert left == [], f"chaos left processes running: {left}"
    assert proc.returncode == 0, out + err[-3000:]
    [sc] = json.loads(report.read_text())["scenarios"]
    assert sc["name"] == scenario and sc["ok"] and sc["violations"] == []
    assert "2 co-located" in sc["cluster"]
    [r] = sc["rounds"]
    assert r["ranks"] == [1] and r["step"] > 1
    assert r["detected_after_s"] <= r["named_after_s"] <= 5.0
    assert r["exit_code"] == 1 and r["exited_after_s"] <= 15.0
    assert r["ranks_left"] == []
    assert not any(is_rank_of(cmdline(p), r["worker_pid"]) for p in r["rank_pids"])
    assert r["fresh_failed"] == [] and r["quiet_after_s"] is not None and r["leaked_pages"] == 0
    assert "hung" not in r["client"]["errors"] and r["client"]["started"] > 0
    assert r["client"]["finished"] and r["client_exit"] == 0  # its run ended, every request too
    parted = next(line for line in r["doctor"] if "parted at step" in line)
    assert f"parted at step {r['step']} (rank 1)" in parted
    if scenario == "tp-desync":
        assert r["dumped_ranks"] == [0, 1] and "a plan digest differs" in r["parted"]
        assert r["fires_on_record"] >= 40 and r["fired_seen"]
    else:
        assert r["dumped_ranks"] == [0] and "was killed by SIGKILL" in r["parted"]
        assert 1.0 <= r["kill_after_s"] <= 2.0
    assert f"{scenario:<16} PASS" in out and "verdict: PASS" in out
