"""Real pdserve processes for tests: started on a free port, always stopped by pid."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.runtime.pids import signal_pdserve, wait_gone


class ServerProcess:
    """`python -m pdserve ARGS --port 0`; waits for its READY line (bounded)."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        ready_timeout_s: float = 120.0,
        env: dict[str, str] | None = None,
    ) -> None:
        """`env`: variables added to this process's environment only (e.g. PDSERVE_FAULTS)."""
        self.args = args
        self.env = env or {}
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.lines: list[str] = []  # everything it printed so far
        self._ready = threading.Event()

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def __enter__(self) -> ServerProcess:
        self.start()
        return self.wait_ready()

    def start(self) -> None:
        """Start the process; `wait_ready` waits for READY (split so several start at once)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", *self.args, "--port", "0", "--host", "127.0.0.1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **self.env},
        )
        log = open(self.log_path, "w")  # noqa: SIM115 - closed by the pump thread

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            with log:
                for line in self.proc.stdout:
                    log.write(line)
                    log.flush()
                    self.lines.append(line)
                    if line.startswith("READY ") and not self._ready.is_set():
                        self.url = line.split()[1]
                        self._ready.set()

        threading.Thread(target=pump, daemon=True).start()

    def wait_ready(self) -> ServerProcess:
        assert self.proc is not None, "not started"
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._ready.wait(0.2):
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


def worker_args(
    model: Path, backend: str = "shm", chunk: int | None = None, kv_mb: int = 16
) -> list[str]:
    """The flags tests give a worker: one thread, a small pool, the given data plane."""
    args = [
        "--model",
        str(model),
        "--threads",
        "1",
        "--kv-budget-mb",
        str(kv_mb),
        "--max-model-len",
        "1024",
        "--backend",
        backend,
    ]
    return args + (["--max-batched-tokens", str(chunk)] if chunk else [])


class LaunchedCluster(ServerProcess):
    """`pdserve launch ... --log-dir DIR`: the launcher plus every child, stopped by pid.

    The children's pids come from the launcher's DIR/cluster.json; `__exit__` SIGKILLs any
    child the launcher left behind, so a failing test cannot leak processes either.
    """

    def __init__(
        self,
        args: list[str],
        log_dir: Path,
        ready_timeout_s: float = 120.0,
        own_key: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        """`own_key`: let launch make the cluster's key (else the run's key, so `http` works);
        `env`: variables added to the launcher's environment (so its children's too)."""
        from pdserve.runtime.cluster_key import KEY_FILE_ENV

        key = [] if own_key else ["--cluster-key-file", os.environ[KEY_FILE_ENV]]
        super().__init__(
            [*args, "--log-dir", str(log_dir), *key],
            log_dir / "launcher.log",
            ready_timeout_s,
            env,
        )
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self.processes: dict[str, dict[str, Any]] = {}  # name -> {pid, url, log}

    def wait_ready(self) -> LaunchedCluster:
        try:
            super().wait_ready()
            table = json.loads((self.log_dir / "cluster.json").read_text())
        except (RuntimeError, OSError, ValueError):
            self._kill_leftovers()
            raise
        self.processes = {p["name"]: p for p in table["processes"]}
        return self

    @property
    def child_pids(self) -> list[int]:
        """From cluster.json once up; before that from the launcher's 'started X (pid N)'."""
        pids = {p["pid"] for p in self.processes.values()}
        for line in list(self.lines):
            m = re.search(r"started \S+ \(pid (\d+)\)", line)
            if m:
                pids.add(int(m.group(1)))
        return sorted(pids)

    def worker_urls(self) -> list[str]:
        return [p["url"] for n, p in self.processes.items() if n != "router"]

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._kill_leftovers()

    def _kill_leftovers(self) -> None:
        """SIGKILL, by pid, the children still running (only pdserve ones: a pid reused by
        then is someone else's), and wait (bounded) for them to be gone."""
        left = [p for p in wait_gone(self.child_pids, 10.0) if signal_pdserve(p, signal.SIGKILL)]
        wait_gone(left, 10.0)


def auth_headers() -> dict[str, str]:
    """JSON, with the cluster key's bearer token when the run has a key (tests/conftest.py)."""
    from pdserve.runtime.cluster_key import ClusterKey

    key = ClusterKey.from_env(None)
    return {"Content-Type": "application/json", **(key.http_headers if key else {})}


def http(
    method: str,
    url: str,
    body: Any = None,
    timeout: float = 60.0,
    raw: bytes | None = None,
    auth: bool = True,
) -> tuple[int, Any]:
    """A tiny JSON client (status, parsed body or text); never raises on HTTP errors.
    `auth`: send the cluster key's token (False: as a stranger would)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = auth_headers() if auth else {"Content-Type": "application/json"}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def worker_pids(url: str) -> list[int]:
    """A worker's processes from its /info: its own and its engine process's where it has one
    (on CUDA by default): what stopping the worker must stop."""
    info = http("GET", url + "/info")[1]
    return [info["pid"]] + ([info["engine_pid"]] if info.get("engine_pid") else [])


def wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Wait until every thread of `pid` is stopped (AssertionError after `timeout_s`): a
    SIGSTOP reaches each thread as it next leaves the kernel, not all at once, so a test that
    needs the process frozen waits for this."""
    deadline = time.monotonic() + timeout_s
    while not _all_stopped(pid):
        assert time.monotonic() < deadline, f"pid {pid} did not stop within {timeout_s} s"
        time.sleep(0.005)


def _all_stopped(pid: int) -> bool:
    """Every thread of `pid` is stopped (T in /proc/PID/task/TID/stat)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] != "T":
                    return False
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
    return True
