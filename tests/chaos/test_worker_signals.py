"""How chaos signals a worker that has an engine process (`serve --engine-process`): a stop
or a resume reaches both of its processes; a kill goes to the worker, whose engine process
the kernel then kills (checked, bounded)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from pdserve.chaos import cluster as chaos_cluster
from pdserve.chaos.cluster import Cluster, ClusterError, WorkerRef
from pdserve.runtime.pids import is_pdserve

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

# A process that `pids.is_pdserve` takes for ours: an argument named pdserve-*.
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)", "pdserve-test-sleeper"]


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_state(pid: int, want: str, timeout_s: float = 5.0) -> str:
    deadline = time.monotonic() + timeout_s
    while (got := _state(pid)) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


@pytest.fixture
def pair() -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    worker, engine = subprocess.Popen(SLEEPER), subprocess.Popen(SLEEPER)
    try:
        deadline = time.monotonic() + 10.0  # until both have exec'd: a pdserve command line
        while not (is_pdserve(worker.pid) and is_pdserve(engine.pid)):
            assert time.monotonic() < deadline, "the sleepers did not start"
            time.sleep(0.01)
        yield worker, engine
    finally:
        for p in (worker, engine):
            p.kill()
            p.wait(10)


def test_stop_and_resume_reach_the_engine_process_too(pair) -> None:
    worker, engine = pair
    cluster = Cluster()  # signals need no router
    ref = WorkerRef("http://w", "prefill", worker.pid, None, None, True, engine.pid)
    cluster.send_signal(ref, signal.SIGSTOP)
    assert _wait_state(worker.pid, "T") == "T" and _wait_state(engine.pid, "T") == "T"
    cluster.send_signal(ref, signal.SIGCONT)
    assert _wait_state(worker.pid, "S") != "T" and _wait_state(engine.pid, "S") != "T"


def test_a_kill_that_leaves_the_engine_process_is_a_cluster_error(pair, monkeypatch) -> None:
    """Here nothing ties the sleeper 'engine' to its 'worker': the kernel does not kill it,
    which is exactly what chaos must report."""
    monkeypatch.setattr(chaos_cluster, "ENGINE_GONE_S", 1.0)
    worker, engine = pair
    cluster = Cluster()  # signals need no router
    ref = WorkerRef("http://w", "decode", worker.pid, None, None, True, engine.pid)
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match="engine process outlived it"):
        cluster.kill(ref)
    assert time.monotonic() - t0 >= 1.0  # it waited its bound first
    assert worker.poll() is not None and engine.poll() is None  # the kill went to the worker


def test_nothing_is_stopped_when_the_engine_pid_is_not_ours(pair) -> None:
    """Every pid is checked before any is signalled: a worker is never left half stopped."""
    worker, _ = pair
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ref = WorkerRef("http://w", "prefill", worker.pid, None, None, True, stranger.pid)
        with pytest.raises(ClusterError, match="not a pdserve process"):
            Cluster().send_signal(ref, signal.SIGSTOP)
        assert _state(worker.pid) != "T" and _state(stranger.pid) != "T"
    finally:
        stranger.kill()
        stranger.wait(10)
