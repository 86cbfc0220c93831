"""A child process of the launcher: started so it cannot outlive us, stopped by its pid.

* Its stdout and stderr go to its own log file (no pipe), so the launcher needs no pump
  threads — which keeps `preexec_fn` safe (fork with no other threads) — and a child never
  blocks on a full pipe or dies of SIGPIPE when the launcher is gone.
* On Linux it asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG), so even a
  SIGKILLed launcher leaves no orphan. The signal is tied to the thread that forked, so
  children must be started from the launcher's main thread.
* READY is the line `READY <url>` the child prints when it serves; `check_ready` scans the
  new part of the log for it and notices a child that exited instead.
* `stop` is SIGTERM, a bounded wait, then SIGKILL — always by pid.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1
TAIL_LINES = 30


def _die_with_parent() -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died between fork and prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def die_with_parent(parent: int) -> None:
    """Called first in a child that runs our code (an engine process, a tensor-parallel rank):
    SIGKILL when `parent`, the process that started it, dies; exit at once if it already has
    (PR_SET_PDEATHSIG on Linux; elsewhere only the check)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        raise SystemExit(1)


class ChildFailed(RuntimeError):
    """A child did not come up or died; the message names it and says how."""

    def __init__(self, message: str, child: Child | None = None) -> None:
        super().__init__(message)
        self.child = child


class Child:
    def __init__(
        self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        """`env`: variables set for this child on top of ours (e.g. its CUDA_VISIBLE_DEVICES)."""
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = dict(env or {})
        self.url: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._scanned = 0  # bytes of the log already searched for READY

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return self._proc.pid

    def start(self) -> None:
        # log lines land in order, as they happen
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=False,  # Ctrl-C on the terminal reaches the whole cluster
                preexec_fn=_die_with_parent(),
            )

    def poll(self) -> int | None:
        """The exit code once the child has exited, else None."""
        return None if self._proc is None else self._proc.poll()

    def check_ready(self) -> bool:
        """Scan the new part of the log for the READY line; raise ChildFailed if it exited."""
        if self.url is None:
            with open(self.log_path, "rb") as f:
                f.seek(self._scanned)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # only whole lines
            self._scanned += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                if line.startswith("READY "):
                    self.url = line.split()[1]
                    return True
        if self.url is not None:
            return True
        code = self.poll()
        if code is not None:
            raise ChildFailed(
                f"{self.name} (pid {self.pid}) exited with code {code} before READY", self
            )
        return False

    def signal(self, sig: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int | None:
        if self._proc is None:
            return None
        try:
            return self._proc.wait(max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL and reap; the forced path after a bounded SIGTERM wait."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)

    def stop(self, timeout_s: float) -> int | None:
        self.signal(signal.SIGTERM)
        if self.wait(timeout_s) is None:
            self.kill()
        return self.poll()

    def log_tail(self, lines: int = TAIL_LINES) -> str:
        """The log's last lines, indented: quoted in our output, a child's READY line must
        not read as our own."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"  | (cannot read {self.log_path}: {e})"
        return "\n".join("  | " + ln for ln in text.splitlines()[-lines:])
