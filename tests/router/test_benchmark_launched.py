"""The benchmarks' `Pdserve` (benchmarks/serving/launched.py) stops what its launch left behind,
by pid, and only pdserve processes: a listed pid the kernel gave to another program is left
alone.

A stand-in launcher (a few lines of Python, no model) prints READY, writes the cluster table
with a leftover worker that outlives it (a pdserve process) and a stranger's pid (as a reused
pid looks), and waits to be stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.serving.launched import Pdserve
from pdserve.runtime.pids import is_pdserve, pid_alive

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

FAKE_LAUNCH = """
import json, subprocess, sys, time
from pathlib import Path
log_dir, stranger = Path(sys.argv[1]), int(sys.argv[2])
# A worker the launcher failed to stop: its own session, no parent-death signal.
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                           "pdserve-worker"], start_new_session=True)
table = {"url": "http://127.0.0.1:9", "processes": [
    {"name": "decode-0", "pid": worker.pid, "url": "", "log": ""},
    {"name": "router", "pid": stranger, "url": "", "log": ""}]}
(log_dir / "cluster.json").write_text(json.dumps(table))
print("READY http://127.0.0.1:9", flush=True)
time.sleep(120)
"""


def test_leftovers_are_killed_and_waited_for_but_never_a_stranger(tmp_path: Path) -> None:
    stranger = subprocess.Popen(["sleep", "120"])  # what a reused pid may belong to
    server = Pdserve(["launch"], tmp_path)
    server.argv = [sys.executable, "-c", FAKE_LAUNCH, str(tmp_path), str(stranger.pid)]
    server.exit_timeout_s = 0.0  # the worker will not exit by itself: kill it at once
    worker = None
    try:
        with server:
            assert server.url == "http://127.0.0.1:9"
            worker = next(p["pid"] for p in server.table() if p["name"] == "decode-0")
            assert pid_alive(worker) and is_pdserve(worker) and not is_pdserve(stranger.pid)
        assert server.child is not None and server.child.poll() is not None
        assert not pid_alive(worker)  # killed, and gone by the time __exit__ returned
        assert stranger.poll() is None  # not a pdserve process: never signalled
    finally:
        stranger.kill()
        stranger.wait(10)
        if worker is not None and pid_alive(worker) and is_pdserve(worker):
            os.kill(worker, signal.SIGKILL)
