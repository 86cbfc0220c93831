"""The supervisor: crashes are counted and survived; a thread that cannot be kept alive
turns health red and the process exits non-zero; a stalled thread turns health red."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from pdserve.runtime.faults import FAULTS, Faults
from pdserve.runtime.supervisor import Supervisor
from tests.procs import ServerProcess, http


def test_crash_is_survived_then_budget_exhausted_is_fatal():
    fatal: list[str] = []
    sup = Supervisor(restart_budget=3, budget_window_s=60, on_fatal=fatal.append)
    calls = {"n": 0}

    def tick() -> None:
        calls["n"] += 1
        if calls["n"] in (2, 4):
            raise RuntimeError("one bad message")
        time.sleep(0.005)

    sup.spawn("ok", tick)
    time.sleep(0.2)
    assert sup.problems() == [] and calls["n"] > 4
    sup.spawn("bad", lambda: (_ for _ in ()).throw(ValueError("always")))
    deadline = time.monotonic() + 5
    while not fatal and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fatal and "bad" in fatal[0]
    assert any("thread bad dead" in p for p in sup.problems())
    assert [r["crashes"] for r in sup.snapshot() if r["name"] == "ok"] == [2]
    assert sup.stop(2.0) == []


def test_stale_heartbeat_is_a_problem():
    sup = Supervisor()
    gate = threading.Event()
    sup.spawn("slow", lambda: gate.wait(1.0), heartbeat_timeout_s=0.2)
    time.sleep(0.5)
    assert any("heartbeat stale" in p for p in sup.problems())
    gate.set()
    sup.stop(2.0)


@pytest.fixture
def faults() -> Iterator[Faults]:
    """The process-wide fault points the supervisor hits, cleared after the test."""
    yield FAULTS
    FAULTS.configure("", 0)


def wait_until(pred: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_kill_0_leaves_the_thread_dead_for_good(faults):
    fatal: list[str] = []
    sup = Supervisor(restart_budget=100, on_fatal=fatal.append)
    ticks = {"n": 0}
    faults.configure("thread.x=kill:0", 0)
    sup.spawn("x", lambda: ticks.__setitem__("n", ticks["n"] + 1))
    wait_until(lambda: bool(fatal))
    faults.configure("", 0)
    time.sleep(0.1)  # a restarted thread would tick now
    (rec,) = sup.snapshot()
    assert rec["alive"] is False and rec["crashes"] == 1 and ticks["n"] == 0
    assert "thread.x" in str(rec["dead_reason"]) and "not restarted" in str(rec["dead_reason"])
    assert fatal == [f"thread x dead: {rec['dead_reason']}"]
    assert [p for p in sup.problems() if p.startswith("thread x dead")]
    assert sup.stop(2.0) == []


def test_kill_1_is_a_crash_and_the_thread_goes_on(faults):
    fatal: list[str] = []
    sup = Supervisor(restart_budget=100, on_fatal=fatal.append)
    ticks = {"n": 0}

    def tick() -> None:
        ticks["n"] += 1
        time.sleep(0.001)

    faults.configure("thread.x=kill:1@0.5", 1)
    sup.spawn("x", tick)
    wait_until(lambda: sup.snapshot()[0]["crashes"] >= 3 and ticks["n"] >= 3)
    faults.configure("", 0)
    seen = ticks["n"]
    wait_until(lambda: ticks["n"] > seen + 3)  # no hit of the old points is in flight now
    crashes, seen = sup.snapshot()[0]["crashes"], ticks["n"]
    wait_until(lambda: ticks["n"] > seen + 20)
    (rec,) = sup.snapshot()
    assert rec["alive"] and rec["crashes"] == crashes and "ThreadKilled" in str(rec["last_error"])
    assert sup.problems() == [] and fatal == []
    assert sup.stop(2.0) == []


def _serve_with_faults(tiny_dir, log, faults: str) -> ServerProcess:
    args = [
        "serve",
        "--role",
        "prefill",
        "--model",
        str(tiny_dir),
        "--threads",
        "1",
        "--kv-budget-mb",
        "8",
    ]
    return ServerProcess(args, log, env={"PDSERVE_FAULTS": faults}).__enter__()


@pytest.mark.process
def test_dead_thread_exits_the_process_non_zero(tiny_dir):
    env = {**os.environ, "PDSERVE_FAULTS": "thread.control=raise"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "serve",
            "--role",
            "prefill",
            "--model",
            str(tiny_dir),
            "--threads",
            "1",
            "--kv-budget-mb",
            "8",
            "--port",
            "0",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "thread control dead" in r.stderr


@pytest.mark.process
def test_stalled_thread_turns_health_red(tiny_dir, tmp_path):
    srv = _serve_with_faults(tiny_dir, tmp_path / "p.log", "thread.control=delay:8")
    try:
        deadline = time.monotonic() + 20
        while True:
            status, body = http("GET", srv.url + "/health", timeout=5)
            if status == 503:
                break
            assert time.monotonic() < deadline, "health never turned red"
            time.sleep(0.2)
        assert any("control" in p for p in body["problems"])
    finally:
        srv.stop()
