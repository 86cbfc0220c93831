"""`pdserve launch`: argv plans (pure), the startup barrier, and no orphan on any stop."""

from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from pdserve.launch import engine_flags
from pdserve.runtime.cluster_key import ClusterKey
from pdserve.runtime.launcher import LaunchConfig, router_argv, worker_argvs
from pdserve.runtime.pids import wait_gone
from tests.procs import LaunchedCluster, http


def config(**kw: object) -> LaunchConfig:
    base: dict[str, object] = dict(
        model_path="/m",
        served_model_name="tiny",
        prefill=1,
        decode=2,
        threads=3,
        engine_flags=("--page-size", "32"),
        log_dir=Path("/tmp/x"),
        cluster_key_file="/tmp/x/cluster.key",
        backend="tcp",
    )
    return LaunchConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_worker_and_router_argv_follow_the_topology():
    plan = dict(worker_argvs(config()))
    assert list(plan) == ["prefill-0", "decode-0", "decode-1"]
    p = plan["prefill-0"]
    assert p[1:6] == ["-m", "pdserve", "--log-level", "INFO", "serve"]
    for flag, value in [
        ("--role", "prefill"),
        ("--port", "0"),
        ("--control-port", "0"),
        ("--backend", "tcp"),
        ("--threads", "3"),
        ("--model", "/m"),
        ("--served-model-name", "tiny"),
        ("--page-size", "32"),
        ("--host", "127.0.0.1"),
        ("--cluster-key-file", "/tmp/x/cluster.key"),
    ]:
        assert p[p.index(flag) + 1] == value, flag
    assert plan["decode-1"][plan["decode-1"].index("--role") + 1] == "decode"
    assert "--control-port" not in plan["decode-0"]
    colo = dict(worker_argvs(config(prefill=0)))
    assert list(colo) == ["colocated-0", "colocated-1"]
    r = router_argv(config(port=0, policy="round-robin"), ["http://p"], ["http://d0", "http://d1"])
    assert r[r.index("--decode") + 1 : r.index("--decode") + 3] == ["http://d0", "http://d1"]
    assert r[r.index("--prefill") + 1] == "http://p" and r[r.index("--policy") + 1] == "round-robin"
    assert "--prefill" not in router_argv(config(prefill=0), [], ["http://d0"])
    assert r[r.index("--cluster-key-file") + 1] == "/tmp/x/cluster.key"  # to call the workers
    with pytest.raises(ValueError, match="--decode >= 1"):
        config(decode=0)


def test_threads_per_role():
    plan = dict(worker_argvs(config(decode_threads=2)))
    threads = {name: argv[argv.index("--threads") + 1] for name, argv in plan.items()}
    assert threads == {"prefill-0": "3", "decode-0": "2", "decode-1": "2"}
    colo = dict(worker_argvs(config(prefill=0, prefill_threads=1)))
    assert {a[a.index("--threads") + 1] for a in colo.values()} == {"3"}
    with pytest.raises(ValueError, match="threads"):
        config(prefill_threads=-1)


def test_a_tp_launch_gives_its_workers_a_flight_directory(tmp_path):
    from pdserve.launch import flight_dir

    def flight(*argv: str) -> str | None:
        args = build_parser().parse_args(["launch", "--model", "m", *argv])
        return flight_dir(args, tmp_path)

    assert flight("--tp", "2") == str(tmp_path.resolve() / "flight")
    assert flight("--decode-tp", "2") == str(tmp_path.resolve() / "flight")
    assert flight("--tp", "2", "--flight-dir", "/x/f") == "/x/f"
    assert flight() is None  # TP 1 has no ranks to dump


def test_each_side_gets_its_own_tp_and_only_ranks_a_flight_directory():
    plan = dict(worker_argvs(config(prefill_tp=2, decode_tp=1, flight_dir="/x/f")))
    last = {name: argv[len(argv) - 1 - argv[::-1].index("--tp") + 1] for name, argv in plan.items()}
    assert last == {"prefill-0": "2", "decode-0": "1", "decode-1": "1"}  # the last --tp wins
    assert ["--flight-dir" in argv for argv in plan.values()] == [True, False, False]
    plain = dict(worker_argvs(config()))
    assert not any("--tp" in argv for argv in plain.values())  # the engine flags' own


def test_a_flight_directory_without_tp_is_refused(tiny_dir, tmp_path, capsys):
    from pdserve.cli import main

    flight = tmp_path / "flight"
    for command in ("serve", "launch"):  # before anything starts
        assert main([command, "--model", str(tiny_dir), "--flight-dir", str(flight)]) == 2
        err = capsys.readouterr().err
        assert f"pdserve {command}: error: a flight directory (--flight-dir) needs --tp 2" in err
    assert not flight.exists()


def test_engine_flags_are_passed_on_as_given():
    args = build_parser().parse_args(
        [
            "launch",
            "--model",
            "builtin:tiny",
            "--max-model-len",
            "1024",
            "--kv-budget-mb",
            "16",
            "--dtype",
            "float32",
        ]
    )
    flags = engine_flags(args)
    assert "--model" not in flags and "--served-model-name" not in flags
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    assert pairs["--max-model-len"] == "1024" and pairs["--kv-budget-mb"] == "16.0"
    assert pairs["--dtype"] == "float32" and pairs["--page-size"] == "16"
    serve = build_parser().parse_args(["serve", *flags])
    assert (serve.max_model_len, serve.kv_budget_mb, serve.dtype) == (1024, 16.0, "float32")
    assert serve.overlap_schedule is None  # not given: each worker's device decides
    off = build_parser().parse_args(["launch", "--model", "m", "--no-overlap-schedule"])
    assert "--no-overlap-schedule" in engine_flags(off)
    assert build_parser().parse_args(["serve", *engine_flags(off)]).overlap_schedule is False
    assert serve.engine_process is None  # likewise: on for CUDA, off on a CPU
    for given, flag in ((False, "--no-engine-process"), (True, "--engine-process")):
        either = build_parser().parse_args(["launch", "--model", "m", flag])
        assert build_parser().parse_args(["serve", *engine_flags(either)]).engine_process is given


def test_the_router_gets_reject_unknown_fields():
    args = build_parser().parse_args(["launch", "--model", "m", "--reject-unknown-fields"])
    assert args.reject_unknown_fields
    assert "--reject-unknown-fields" in router_argv(
        config(reject_unknown_fields=True), [], ["http://d0"]
    )
    assert "--reject-unknown-fields" not in router_argv(config(), [], ["http://d0"])
    r = router_argv(config(policy="prefix", prefix_max_imbalance=3), [], ["http://d0"])
    assert r[r.index("--prefix-max-imbalance") + 1] == "3" and "--prefix-index-pages" not in r


def started_pids(output: str) -> list[int]:
    return [int(m) for m in re.findall(r"started \S+ \(pid (\d+)\)", output)]


@pytest.mark.process
def test_startup_failure_names_the_worker_and_stops_everything(tmp_path):
    empty = tmp_path / "no-model"  # a directory without config.json: `serve` exits with 2
    empty.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve",
            "launch",
            "--prefill",
            "0",
            "--decode",
            "2",
            "--model",
            str(empty),
            "--threads",
            "1",
            "--port",
            "0",
            "--log-dir",
            str(tmp_path / "logs"),
            "--startup-timeout",
            "60",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    pids = started_pids(out)
    assert len(pids) == 2, out
    assert wait_gone(pids, 10.0) == []
    assert proc.returncode == 1, out
    assert re.search(r"startup failed: colocated-[01] \(pid \d+\) exited with code 2", out), out
    assert "  | pdserve serve: error:" in out and "config.json" in out  # the child's own words
    assert not re.search(r"^READY", out, re.M) and "started router" not in out


def flags(tiny_dir: Path) -> list[str]:
    return [
        "--model",
        str(tiny_dir),
        "--kv-budget-mb",
        "16",
        "--max-model-len",
        "256",
        "--threads",
        "1",
    ]


@pytest.fixture(scope="module")
def clusters(
    tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LaunchedCluster, LaunchedCluster]]:
    """Two one-worker clusters, started side by side: one to SIGTERM, one to SIGKILL."""
    logs = tmp_path_factory.mktemp("launch")
    a = LaunchedCluster(
        ["launch", "--prefill", "0", "--decode", "1", *flags(tiny_dir)], logs / "a", own_key=True
    )
    b = LaunchedCluster(["launch", "--prefill", "0", "--decode", "1", *flags(tiny_dir)], logs / "b")
    try:
        a.start()
        b.start()
        yield a.wait_ready(), b.wait_ready()
    finally:
        a.__exit__()
        b.__exit__()


@pytest.mark.process
def test_launch_makes_a_cluster_key_that_its_workers_require(clusters):
    c = clusters[0]
    key_file = c.log_dir / "cluster.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    key = ClusterKey.load(key_file)
    worker = c.processes["colocated-0"]["url"]
    assert http("GET", worker + "/debug/state", auth=False)[0] == 401
    assert http("GET", worker + "/debug/state")[0] == 401  # the test run's key is another one
    req = urllib.request.Request(worker + "/debug/state", headers=key.http_headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
    assert http("GET", worker + "/health", auth=False)[0] == 200  # liveness stays open
    router = c.url
    # The router came up: its startup read the workers' /info, which needs the key.
    assert http("GET", router + "/v1/models", auth=False)[0] == 200


@pytest.mark.process
def test_the_router_runs_uvloop_and_the_worker_asyncios_loop(clusters):
    """runtime/evloop.py: a worker's loop shares the GIL with its engine thread, so `auto`
    keeps it on asyncio's loop; the router runs uvloop where it is installed."""
    c = clusters[1]
    router_loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    logs = {name: Path(p["log"]).read_text() for name, p in c.processes.items()}
    assert "event loop: asyncio" in logs["colocated-0"], logs["colocated-0"][-2000:]
    assert f"event loop: {router_loop}" in logs["router"], logs["router"][-2000:]


@pytest.mark.process
def test_sigterm_stops_every_child(clusters):
    c = clusters[0]
    pids = c.child_pids
    assert len(pids) == 2 and set(c.processes) == {"colocated-0", "router"}
    assert c.proc is not None
    c.proc.send_signal(signal.SIGTERM)
    assert c.proc.wait(30) == 0
    assert wait_gone(pids, 5.0) == []
    log = c.log()
    assert "stopping the cluster" in log and "router exited 0, colocated-0 exited 0" in log


@pytest.mark.process
def test_sigkill_of_the_launcher_takes_its_children_down(clusters):
    c = clusters[1]
    pids = c.child_pids
    assert len(pids) == 2 and c.proc is not None
    c.proc.kill()  # no handler runs: only PR_SET_PDEATHSIG can stop the children now
    c.proc.wait(10)
    assert wait_gone(pids, 10.0) == []


def test_launch_starts_several_router_processes_on_cuda_only():
    from pdserve.launch import CUDA_ROUTER_PROCESSES, router_processes

    assert router_processes("cpu", 64) == 1
    assert router_processes("cuda", 16) == CUDA_ROUTER_PROCESSES == 4
    assert router_processes("cuda:1", 8) == 2  # a quarter of the CPUs at most
    assert router_processes("cuda", 2) == 1
