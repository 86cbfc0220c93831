"""runtime/pids.py on real short-lived children: alive, ours or not, signalled, gone.

The children are `sleep` or a sleeping Python whose arguments look like pdserve's; none loads
pdserve, so each starts in milliseconds.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from pdserve.runtime.pids import cmdline, is_pdserve, pid_alive, signal_pdserve, wait_gone

SLEEP = "import time; time.sleep(120)"


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    """The test's children; whatever the test did, each is killed and reaped at the end."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def start(children: list[subprocess.Popen[bytes]], argv: list[str]) -> int:
    """A child whose command line is readable: Popen can return (vfork) between the kernel
    releasing the parent and its setting the new program's arguments, a window in which
    /proc/PID/cmdline reads empty (seen once in `make test` under load)."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    children.append(proc)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            if f.read():
                break
        time.sleep(0.001)
    return proc.pid


@pytest.mark.process
def test_a_stranger_is_alive_never_signalled_and_gone_once_killed(
    children: list[subprocess.Popen[bytes]],
) -> None:
    pid = start(children, ["sleep", "120"])
    assert pid_alive(pid)
    assert not is_pdserve(pid)
    assert not signal_pdserve(pid, signal.SIGKILL)  # not ours: refused
    assert wait_gone([pid], 0.0) == [pid]  # still running; the wait ended at its bound
    children[0].kill()
    assert wait_gone([pid], 10.0) == []  # a zombie (not reaped yet) counts as gone
    assert not pid_alive(pid)
    children[0].wait(10)
    assert wait_gone([pid], 10.0) == []  # reaped: no process at all


@pytest.mark.process
def test_a_pdserve_process_is_signalled_through_its_pidfd(
    children: list[subprocess.Popen[bytes]],
) -> None:
    ours = start(children, [sys.executable, "-c", SLEEP, "/opt/venv/bin/pdserve"])
    module = start(children, [sys.executable, "-c", SLEEP, "-m", "pdserve.chaos.client"])
    under_dir = start(children, [sys.executable, "-c", SLEEP, "/src/pdserve/notes.txt"])
    assert is_pdserve(ours) and is_pdserve(module)
    assert not is_pdserve(under_dir)  # names a file in a pdserve/ directory: not pdserve
    assert wait_gone([under_dir, ours, module], 0.0) == [under_dir, ours, module]
    assert cmdline(module)[1:] == ["-c", SLEEP, "-m", "pdserve.chaos.client"]
    # pdserve, but not the process meant (a pid handed out again): refused
    assert not signal_pdserve(module, signal.SIGKILL, lambda argv: "--parent" in argv)
    assert signal_pdserve(ours, signal.SIGKILL, lambda argv: argv[-1].endswith("/pdserve"))
    assert wait_gone([ours], 10.0) == []
    assert wait_gone([under_dir, ours, module], 0.0) == [under_dir, module]  # only it was hit
    assert children[0].wait(10) == -signal.SIGKILL
    assert not signal_pdserve(ours, signal.SIGKILL)  # reaped: nothing to signal


@pytest.mark.process
def test_without_a_pidfd_wait_gone_polls_proc(
    children: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_pidfd(pid: int) -> int:
        raise OSError(errno.EINVAL, "no pidfd")

    pid = start(children, ["sleep", "120"])
    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    assert wait_gone([pid], 0.0) == [pid]
    children[0].kill()
    assert wait_gone([pid], 10.0) == []


@pytest.mark.parametrize("pid", [0, -1, True])
def test_signal_refuses_what_kill_would_read_as_a_group(pid: int) -> None:
    with pytest.raises(ValueError, match="not a process id"):
        signal_pdserve(pid, signal.SIGKILL)
