"""The cluster's own MPS daemon (runtime/mps.py): started, waited for, stopped by its pid.

MPS needs an NVIDIA driver, so the control program here is a STAND-IN, named as such: a short
Python script that speaks the real one's protocol as far as the launcher uses it (`-f` runs in
the foreground and makes the `control` FIFO in CUDA_MPS_PIPE_DIRECTORY; run without it, it
writes its stdin, `quit`, into that FIFO). What is tested is our side: the env the workers get,
the wait for the pipe, the bounded stop and its escalation, and the refusals. The real daemon
runs under `launch --mps` on the lent GPU (benchmarks/serving/gpu_serving.py's `-mps` clusters).
"""

from __future__ import annotations

import os
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest

from pdserve.runtime.child import ChildFailed
from pdserve.runtime.mps import LOG_ENV, PIPE_ENV, MpsDaemon

pytestmark = pytest.mark.process  # every test here starts the stand-in daemon

STAND_IN = """\
#!{python}
# A STAND-IN for nvidia-cuda-mps-control (tests/runtime/test_mps.py): no MPS here.
import os, signal, sys, time
pipe = os.path.join(os.environ["CUDA_MPS_PIPE_DIRECTORY"], "control")
mode = os.environ.get("STAND_IN_MODE", "")
if sys.argv[1:] != ["-f"]:  # the client: what it reads goes to the daemon
    with open(pipe, "w") as f:
        f.write(sys.stdin.read())
    sys.exit(0)
if mode == "exit":
    sys.exit(3)
if mode == "stubborn":  # quit and SIGTERM are ignored: only SIGKILL stops it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode != "mute":
    os.mkfifo(pipe)
while True:
    if mode == "mute":
        time.sleep(0.05)
        continue
    with open(pipe) as f:
        if "quit" in f.read() and mode != "stubborn":
            sys.exit(0)
"""


def stand_in(tmp_path: Path) -> str:
    exe = tmp_path / "nvidia-cuda-mps-control"
    exe.write_text(STAND_IN.format(python=sys.executable))
    exe.chmod(0o755)
    return str(exe)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_daemon_starts_gives_its_clients_a_private_pipe_and_quits(tmp_path, monkeypatch):
    monkeypatch.delenv("STAND_IN_MODE", raising=False)
    mps = MpsDaemon(tmp_path / "logs", stand_in(tmp_path))
    env = mps.start(timeout_s=10)
    try:
        assert env == {PIPE_ENV: str(tmp_path / "logs/mps-pipe"), LOG_ENV: str(mps.logs)}
        assert (mps.pipe / "control").exists()
        assert mps.child is not None and alive(mps.child.pid)
    finally:
        stuck = mps.stop(timeout_s=10)
    assert stuck is False and mps.child.poll() == 0  # it quit when told
    assert mps.stop(timeout_s=10) is False  # once stopped, stopping again does nothing


def test_a_daemon_deaf_to_quit_and_sigterm_is_killed_by_pid(tmp_path, monkeypatch):
    monkeypatch.setenv("STAND_IN_MODE", "stubborn")
    mps = MpsDaemon(tmp_path, stand_in(tmp_path))
    mps.start(timeout_s=10)
    assert mps.child is not None
    t0 = time.monotonic()
    assert mps.stop(timeout_s=0.5) is True  # it needed SIGKILL
    assert mps.child.poll() == -9 and time.monotonic() - t0 < 10


def test_a_daemon_that_exits_or_never_listens_fails_the_start_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("STAND_IN_MODE", "exit")
    with pytest.raises(ChildFailed, match="exited 3 before it listened"):
        MpsDaemon(tmp_path / "a", stand_in(tmp_path)).start(timeout_s=10)
    monkeypatch.setenv("STAND_IN_MODE", "mute")
    mps = MpsDaemon(tmp_path / "b", stand_in(tmp_path))
    with pytest.raises(ChildFailed, match="no control pipe within 1s"):
        mps.start(timeout_s=1)
    assert mps.child is not None and mps.child.poll() is not None  # stopped, not left behind


def test_no_control_program_and_no_gpu_are_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing named nvidia-cuda-mps-control here
    with pytest.raises(ChildFailed, match="not on PATH"):
        MpsDaemon(tmp_path).start(timeout_s=1)
    from pdserve.launch import cmd_launch

    args = Namespace(prefill_tp=0, decode_tp=0, device="cpu", gpus="auto", mps=True)
    monkeypatch.setattr("pdserve.launch.launch_backend", lambda a: "shm")
    assert cmd_launch(args) == 2
    assert "--mps needs the workers on CUDA, not cpu" in capsys.readouterr().err


def test_a_launch_with_mps_gives_every_worker_the_daemon_and_stops_it_last(tmp_path):
    from pdserve.runtime.launcher import LaunchConfig, Launcher

    cfg = LaunchConfig(
        model_path="unused",
        served_model_name="unused",
        prefill=1,
        decode=1,
        threads=1,
        engine_flags=(),
        log_dir=tmp_path,
        cluster_key_file=str(tmp_path / "key"),
        mps=True,
    )
    launcher = Launcher(cfg)
    assert launcher.mps is not None and launcher.mps.pipe == tmp_path / "mps-pipe"
    launcher.mps.exe = stand_in(tmp_path)
    spawned: list[tuple[str, dict[str, str]]] = []

    def spawn(name, argv, env=None):  # what each worker would get; no worker is started
        spawned.append((name, env or {}))
        raise ChildFailed(f"{name}: not started in this test")

    launcher._spawn = spawn  # type: ignore[method-assign]
    with pytest.raises(ChildFailed, match="prefill-0: not started"):
        launcher._start()
    assert spawned == [("prefill-0", launcher.mps.env)]
    pid = launcher.mps.child.pid
    assert alive(pid)
    assert launcher._stop_all() is False  # the daemon quit when told, after the workers
    assert not alive(pid)
