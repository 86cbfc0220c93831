"""The first hour, run as a user would: the real commands, a busy port, Ctrl-C twice.

* `pdserve serve` and `pdserve router` on a port in use: one clear line, exit status 2, before
  any model or tokenizer is loaded.
* A client that disconnects mid-stream is one INFO line, not an ERROR traceback.
* Ctrl-C drains (a running stream goes on); a second Ctrl-C stops at once with status 130.
* `pdserve router` stopped by Ctrl-C while it still waits for its workers exits 0 promptly.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import ServerProcess

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

WAIT_S = 30.0
# Each engine tick stalls 20 ms: a long stream stays in flight for the whole test.
SLOW_ENGINE = {"PDSERVE_FAULTS": "thread.engine=delay:0.02"}


def pdserve(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_a_busy_port_is_one_line_and_exit_2_before_anything_loads(tiny_dir: Path):
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = str(held.getsockname()[1])
        for args in (
            ["serve", "--model", str(tiny_dir)],
            ["router", "--model", str(tiny_dir), "--decode", "http://127.0.0.1:9"],
        ):
            r = pdserve(*args, "--host", "127.0.0.1", "--port", port)
            out = r.stdout + r.stderr
            assert r.returncode == 2, out
            assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in out
            assert "Traceback" not in out and "loaded" not in out, out
            assert len([line for line in out.splitlines() if line.strip()]) == 1, out


Stream = tuple[http.client.HTTPConnection, http.client.HTTPResponse]


def stream(url: str, max_tokens: int) -> Stream:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
    body = {"prompt": "abc " * 8, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def next_event(resp: http.client.HTTPResponse) -> bytes:
    line = resp.readline()
    while line == b"\n":
        line = resp.readline()
    return line


def wait_for_line(srv: ServerProcess, text: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not any(text in line for line in srv.lines):
        assert time.monotonic() < deadline, f"no {text!r} in:\n{''.join(srv.lines[-20:])}"
        time.sleep(0.05)


def test_disconnect_is_one_info_line_and_ctrl_c_twice_stops_at_once(tiny_dir: Path, tmp_path: Path):
    args = ["serve", "--model", str(tiny_dir), "--threads", "1", "--max-model-len", "1024"]
    with ServerProcess(args, tmp_path / "serve.log", env=SLOW_ENGINE) as srv:
        assert srv.proc is not None
        conn, resp = stream(srv.url, 900)
        assert next_event(resp).startswith(b"data: ")
        resp.close()  # the client goes away mid-stream
        conn.close()
        wait_for_line(srv, "the client disconnected")

        conn, resp = stream(srv.url, 900)
        assert next_event(resp).startswith(b"data: ")
        srv.proc.send_signal(signal.SIGINT)
        wait_for_line(srv, "shutting down (SIGINT): 1 requests running")
        for _ in range(3):  # draining: the stream goes on
            assert next_event(resp).startswith(b"data: {")
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(WAIT_S) == 128 + signal.SIGINT
        conn.close()
        log = srv.log()
    disconnects = [line for line in log.splitlines() if "the client disconnected" in line]
    assert len(disconnects) == 1 and " INFO " in disconnects[0], log
    assert "SIGINT again: stopping now" in log
    assert "Traceback" not in log and " ERROR " not in log, log


def test_router_stops_on_ctrl_c_while_it_waits_for_its_workers(tiny_dir: Path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "router", "--model", str(tiny_dir), "--port", "0"]
        + ["--decode", "http://127.0.0.1:9", "--startup-timeout", "600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # until it waits for its (absent) worker
            if "workers to answer GET /info" in line:
                break
        proc.send_signal(signal.SIGINT)
        assert proc.wait(WAIT_S) == 0
    finally:
        proc.kill()
        proc.wait(10)
