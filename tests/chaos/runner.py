"""Running `pdserve chaos` from a test: the run launches and stops its own cluster, and the
test still owns every process it started: whatever happens, `run_chaos` SIGKILLs by pid
anything left of them (the launcher and its children from cluster.json, the chaos clients from
their progress files)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from pdserve.runtime.pids import pid_alive, wait_gone


def started_pids(work: Path) -> list[int]:
    pids = []
    for table in work.glob("cluster-*/cluster.json"):
        doc = json.loads(table.read_text())
        pids += [doc["launcher_pid"], *(p["pid"] for p in doc["processes"])]
    for progress in work.glob("*.json"):
        try:
            pids.append(json.loads(progress.read_text())["pid"])
        except (ValueError, KeyError):
            pass
    return pids


def kill_leftovers(work: Path) -> list[int]:
    left = [p for p in started_pids(work) if pid_alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    wait_gone(left, 10.0)
    return left


def run_chaos(args: list[str], work: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pdserve", "chaos", *args, "--work-dir", str(work)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        left = kill_leftovers(work)
    assert left == [], f"chaos left processes running: {left}"
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
