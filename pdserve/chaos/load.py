"""The harness's handle on one chaos client process (pdserve/chaos/client.py).

The client is a separate process so that the harness can SIGKILL it: that is the abort
storm, every open stream dying at once the way a crashed frontend drops them. What it did
is read back from its progress file, which survives the kill. The process is always ended
by its pid: `kill()` is idempotent and the scenarios call it in a `finally`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.chaos.client import read_progress
from pdserve.runtime.child import _die_with_parent

START_S = 30.0  # the client imports aiohttp and opens its sessions; generous on 2 busy cores


@dataclass(frozen=True)
class LoadSpec:
    sessions: int
    seed: int
    max_tokens: int = 16
    timeout_s: float = 20.0  # each request's own timeout (the router and D enforce it)
    abandon: float = 0.0  # the chance that the client closes a stream after its first chunk
    duration_s: float | None = None  # None: until killed


class LoadProcess:
    def __init__(self, url: str, spec: LoadSpec, progress: Path) -> None:
        self.url = url
        self.spec = spec
        self.progress_path = progress
        self.log_path = progress.with_suffix(".log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.killed_at: float | None = None  # monotonic time of our SIGKILL

    def start(self) -> LoadProcess:
        s = self.spec
        self.progress_path.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "pdserve.chaos.client", "--url", self.url]
        argv += ["--sessions", str(s.sessions), "--seed", str(s.seed)]
        argv += ["--max-tokens", str(s.max_tokens), "--timeout", str(s.timeout_s)]
        argv += ["--abandon", str(s.abandon), "--progress", str(self.progress_path)]
        if s.duration_s is not None:
            argv += ["--duration", str(s.duration_s)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent(),  # never outlives the harness
            )
        return self

    def progress(self) -> dict[str, Any]:
        return read_progress(self.progress_path) or {}

    def wait_loaded(self, timeout_s: float = START_S) -> bool:
        """True once the first request went out; False if it died or took too long."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.progress().get("load_started_unix") is not None:
                return True
            if self.proc is None or self.proc.poll() is not None:
                return False
            time.sleep(0.05)
        return False

    def kill(self) -> float:
        """SIGKILL by pid (once) and reap; the monotonic time of the kill."""
        if self.killed_at is None:
            self.killed_at = time.monotonic()
            if self.proc is not None and self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)
        return self.killed_at

    def stop(self) -> None:
        """End the run now as its --duration would (SIGUSR1: no new request, those in flight
        end within their bound, `finished`); then `wait_exit`. Only once the load started
        (`wait_loaded`): before, the client has no handler and SIGUSR1 would kill it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGUSR1)

    def wait_exit(self, timeout_s: float) -> int | None:
        """Wait for a --duration run to end by itself; SIGKILL it past the bound."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def log_tail(self, lines: int = 10) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
