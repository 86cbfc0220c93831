"""A real wedge, and `pdserve doctor` naming it: the decode worker's control thread stalls.

The decode worker runs with PDSERVE_FAULTS=thread.control=delay:60 (that process only): its
control thread sleeps before every tick, so its PrefillRequest never leaves and its room
cannot progress. The prefill worker and the router are healthy. A request sent straight to
the decode worker gets a room; doctor must exit 2 and name the control thread and the room.
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from http.client import HTTPException
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from tests.procs import ServerProcess, auth_headers, http, worker_args

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

STALL = "thread.control=delay:60"  # far past the test; the worker is stopped before it ticks


@pytest.fixture
def stalled_decode(tiny_dir: Path, tmp_path: Path) -> Iterator[dict[str, str]]:
    common = worker_args(tiny_dir, "shm")
    procs: list[ServerProcess] = []
    with ExitStack() as stack:
        stack.callback(stop_all, procs)
        p = ServerProcess(["serve", "--role", "prefill", *common], tmp_path / "p.log")
        # ERROR: the fault's warning, logged from the control thread as the worker prints
        # READY, can land inside the READY line (see the note in docs/reliability.md).
        d = ServerProcess(
            ["--log-level", "ERROR", "serve", "--role", "decode", *common],
            tmp_path / "d.log",
            env={"PDSERVE_FAULTS": STALL},
        )
        procs += [p, d]
        p.start()
        d.start()
        p.wait_ready()
        d.wait_ready()
        router = ServerProcess(
            ["router", "--prefill", p.url, "--decode", d.url, "--model", str(tiny_dir)],
            tmp_path / "router.log",
        )
        procs.insert(0, router)
        router.start()
        router.wait_ready()
        control = http("GET", p.url + "/info")[1]["control"]
        yield {"p": p.url, "d": d.url, "router": router.url, "control": control}


def stop_all(procs: list[ServerProcess]) -> None:
    """SIGTERM all at once, then wait for each (by pid, bounded, SIGKILL past it): the
    stalled decode worker spends its supervisor's 5 s bound, the others overlap with it."""
    for proc in procs:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.proc.send_signal(signal.SIGTERM)
    for proc in procs:
        proc.stop()


def generate_in_background(d_url: str, control: str, rid: str) -> None:
    body = {
        "request_id": rid,
        "prompt_ids": [5, 6, 7, 8],
        "prefill": control,
        "timeout_s": 30,
        "params": {"max_tokens": 4, "temperature": 0},
    }
    req = urllib.request.Request(d_url + "/generate", json.dumps(body).encode(), auth_headers())

    def run() -> None:
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()
        except (OSError, HTTPException):
            pass  # the worker is stopped at the end of the test, mid-stream; nobody reads this

    threading.Thread(target=run, daemon=True).start()


def test_doctor_names_the_stalled_thread_and_the_stuck_room(stalled_decode):
    urls = stalled_decode
    generate_in_background(urls["d"], urls["control"], "wedged-request")
    deadline = time.monotonic() + 30.0
    while True:  # wait until the room is open behind the stale thread
        state = http("GET", urls["d"] + "/debug/state", timeout=10)[1]
        control = next(t for t in state["threads"] if t["name"] == "control")
        rooms = state["engine"]["role"]["rooms"]
        if rooms and control["heartbeat_age_s"] > control["heartbeat_timeout_s"]:
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
    assert http("GET", urls["d"] + "/health")[0] == 503
    # The doctor runs in this process, as `pdserve doctor` parses and runs it: the room lives
    # only PEER_TIMEOUT_S (5 s) once open (D's stalled control thread hears no Pong, so it
    # declares P dead and ends the room), and a fresh interpreter's start under load took
    # longer than that (tests/doctor/test_doctor_launched.py runs the command as a process).
    args = build_parser().parse_args(["doctor", "--url", urls["router"]])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = args.func(args)
    out = buf.getvalue()
    assert code == 2, out
    assert "thread control is stale" in out, out
    assert f"room {rooms[0]['room']} (request wedged-request" in out, out
    assert "VERDICT: wedged" in out and urls["d"] in out.splitlines()[-1], out
