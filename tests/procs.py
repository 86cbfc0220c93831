"""Real pdserve processes for tests: started on a free port, always stopped by pid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


class ServerProcess:
    """`python -m pdserve ARGS --port 0`; waits for its READY line (bounded)."""

    def __init__(self, args: list[str], log_path: Path, ready_timeout_s: float = 120.0) -> None:
        self.args = args
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def __enter__(self) -> ServerProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", *self.args, "--port", "0", "--host", "127.0.0.1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=os.environ.copy(),
        )
        ready = threading.Event()
        log = open(self.log_path, "w")  # noqa: SIM115 - closed by the pump thread

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            with log:
                for line in self.proc.stdout:
                    log.write(line)
                    log.flush()
                    if line.startswith("READY "):
                        self.url = line.split()[1]
                        ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout_s
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start: {self.log_path.read_text()[-3000:]}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text()


def http(
    method: str, url: str, body: Any = None, timeout: float = 60.0, raw: bytes | None = None
) -> tuple[int, Any]:
    """A tiny JSON client (status, parsed body or text); never raises on HTTP errors."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text
