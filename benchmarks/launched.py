"""The processes a benchmark starts: `python -m pdserve ...` until its READY line, stopped by pid.

Shared by the benchmark scripts (tests have their own, tests/procs.py). `Pdserve` runs `serve`
or `launch` on port 0, copies its output to a log while watching for `READY <url>`, and on
exit stops it (SIGTERM, a bounded wait, SIGKILL) and then, for `launch`, every process its
cluster table lists, by pid, in case the launcher could not (also when the run failed or was
interrupted while starting). `wait_healthy` polls a URL's /health for a process started
otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0


class Pdserve:
    """`python -m pdserve ARGS --port 0`, up once it prints READY URL."""

    def __init__(self, args: list[str], log_dir: Path, log_level: str = "WARNING") -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        if args[0] == "launch":
            args = [*args, "--log-dir", str(log_dir)]
        self.argv = [sys.executable, "-m", "pdserve", "--log-level", log_level, *args]
        self.argv += ["--port", "0"]
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def __enter__(self) -> Pdserve:
        try:
            self._start()
        except BaseException:  # also Ctrl-C or SIGTERM while it starts: stop what started
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        ready = threading.Event()
        log = open(self.log_dir / "stdout.log", "w")  # noqa: SIM115 - the pump closes it

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            with log:
                for line in self.proc.stdout:
                    log.write(line)
                    if line.startswith("READY "):
                        self.url = line.split()[1]
                        ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(self.argv)} did not start; see {self.log_dir}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        children = [int(p["pid"]) for p in self.table()]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in children:  # the launcher stops them; this is for when it could not
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def table(self) -> list[dict[str, Any]]:
        """`launch`'s process table (name, pid, url of each process); empty for `serve`."""
        path = self.log_dir / "cluster.json"
        return json.loads(path.read_text())["processes"] if path.exists() else []


def wait_healthy(url: str, proc: subprocess.Popen[Any], timeout_s: float) -> None:
    """Until `url`/health answers 200; RuntimeError if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy within {timeout_s:.0f}s")
