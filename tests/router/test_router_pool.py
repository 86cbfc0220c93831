"""A router of several processes on one port (router/pool.py): `pdserve launch
--router-processes 2` on the tiny model, and the pieces that need no cluster."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from pdserve.router.pool import child_argv
from pdserve.runtime.pids import wait_gone
from pdserve.server.listener import bind
from tests.procs import LaunchedCluster, http

COMPLETION = {"model": "tiny", "prompt": "def main():", "max_tokens": 4, "temperature": 0}


def test_a_child_takes_the_parents_flags_with_its_own_port_and_share():
    argv = ["--log-level", "DEBUG", "router", "--decode", "http://a:1", "http://b:2", "--model",
            "m", "--port", "0", "--processes", "4", "--max-queue", "10"]  # fmt: skip
    child = child_argv(argv, 4321, 3)
    assert child[:3] == [sys.executable, "-m", "pdserve"]
    args = build_parser().parse_args(child[3:])
    assert (args.processes, args.port, args.max_queue, args.reuse_port) == (1, 4321, 3, True)
    assert args.decode == ["http://a:1", "http://b:2"] and args.log_level == "DEBUG"


def test_a_held_port_takes_no_connection_and_shares_the_port():
    """The parent's socket (SO_REUSEPORT, not listening) holds the port: a plain bind there
    fails, a router's reuse-port socket binds beside it and is handed every connection."""
    held = bind("127.0.0.1", 0, reuse_port=True, listen=False)
    port = held[0].getsockname()[1]
    serving = bind("127.0.0.1", port, reuse_port=True)
    try:
        with pytest.raises(OSError) as e:
            bind("127.0.0.1", port)
        assert e.value.errno == errno.EADDRINUSE
        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(16)]
        serving[0].settimeout(5)
        accepted = [serving[0].accept()[0] for _ in clients]
        for s in clients + accepted:
            s.close()
    finally:
        for s in held + serving:
            s.close()


@pytest.mark.process
def test_a_busy_port_is_exit_status_2_before_anything_starts(tmp_path: Path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "pdserve", "router", "--decode", "http://127.0.0.1:9",
             "--model", str(tmp_path), "--port", str(port), "--processes", "3"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "the port is in use" in done.stderr


@pytest.mark.process
def test_processes_out_of_range_are_refused(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "router", "--decode", "http://127.0.0.1:9", "--model",
         str(tmp_path), "--port", "0", "--processes", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "--processes must be in [1, 64]" in done.stderr


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedCluster]:
    logs = tmp_path_factory.mktemp("router-pool")
    flags = ["--model", str(tiny_dir), "--served-model-name", "tiny", "--kv-budget-mb", "16",
             "--max-model-len", "1024", "--threads", "1"]  # fmt: skip
    with LaunchedCluster(
        ["launch", "--prefill", "0", "--decode", "1", "--router-processes", "2", *flags],
        logs / "cluster",
    ) as c:
        yield c


def router_pid(url: str) -> int:
    status, body = http("GET", url + "/debug/cluster")  # a new connection each call
    assert status == 200, body
    return int(body["router"]["pid"])


def completions_ok(url: str) -> int:
    _, text = http("GET", url + "/metrics")
    for line in text.splitlines():
        if line.startswith('pdserve_router_requests_total{outcome="ok"}'):
            return int(float(line.split()[1]))
    raise AssertionError("no pdserve_router_requests_total{outcome=ok} in /metrics")


@pytest.mark.process
def test_both_processes_serve_and_the_metrics_count_for_both(cluster: LaunchedCluster):
    before = completions_ok(cluster.url)
    texts = set()
    for _ in range(12):
        status, body = http("POST", cluster.url + "/v1/completions", COMPLETION)
        assert status == 200, body
        texts.add(body["choices"][0]["text"])
    assert len(texts) == 1  # greedy: every process routes to the same worker alike
    pids = {router_pid(cluster.url) for _ in range(24)}
    assert len(pids) == 2, pids  # 24 connections spread over two: all on one is 2**-23
    assert completions_ok(cluster.url) - before == 12  # whichever process answers the scrape


@pytest.mark.process
def test_a_dead_process_is_started_again_and_the_others_serve_meanwhile(
    cluster: LaunchedCluster,
):
    pids = {router_pid(cluster.url) for _ in range(24)}
    victim = pids.pop()
    os.kill(victim, signal.SIGKILL)
    assert wait_gone([victim], 10.0) == []
    status, _ = http("POST", cluster.url + "/v1/completions", COMPLETION)
    assert status == 200  # a new connection reaches the process that lives
    deadline = time.monotonic() + 60
    seen: set[int] = set()
    while time.monotonic() < deadline:
        seen |= {router_pid(cluster.url) for _ in range(8)}
        if len(seen - {victim}) == 2:
            break
        time.sleep(0.5)
    assert victim not in seen and len(seen) == 2, seen
    assert "router-" in (cluster.log_dir / "router.log").read_text()


@pytest.mark.process
def test_stopping_the_cluster_stops_every_router_process(cluster: LaunchedCluster):
    pids = {router_pid(cluster.url) for _ in range(24)}
    assert cluster.stop() == 0
    assert wait_gone(sorted(pids), 10.0) == []
    log = (cluster.log_dir / "router.log").read_text()
    assert log.count("shutting down (SIGTERM)") >= 2  # each drained, as one router does
