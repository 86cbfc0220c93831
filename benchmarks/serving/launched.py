"""The processes a benchmark starts: `python -m pdserve ...` until its READY line, stopped by pid.

Shared by the benchmark scripts (tests have their own, tests/procs.py). `Pdserve` runs `serve`
or `launch` on port 0 as a `runtime.child.Child` (its output to LOG_DIR/stdout.log, no pipe;
it dies with us), waits for its `READY <url>` line, and on exit stops it (SIGTERM, a bounded
wait, SIGKILL). For `launch` it then makes sure every process of the cluster table is gone:
the launcher stops them and they die with it, so this only waits (bounded); one still running
is SIGKILLed only if it is still a pdserve process (a pid the kernel gave to someone else is
left alone), and waited for again. Also when the run failed or was interrupted while
starting. `wait_healthy` polls a URL's /health for a process started otherwise;
`engine_pid` reads a launched worker's engine process from its /info.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.runtime.child import Child, ChildFailed
from pdserve.runtime.cluster_key import ClusterKey
from pdserve.runtime.pids import is_pdserve, signal_pdserve, wait_gone

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
EXIT_TIMEOUT_S = 10.0  # for the cluster's processes to exit after the launcher stopped
GONE_TIMEOUT_S = 10.0  # for those SIGKILLed then to be gone
POLL_S = 0.2


class Pdserve:
    """`python -m pdserve ARGS --port 0`, up once it prints READY URL."""

    def __init__(self, args: list[str], log_dir: Path, log_level: str = "WARNING") -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        if args[0] == "launch":
            args = [*args, "--log-dir", str(log_dir)]
        self.argv = [sys.executable, "-m", "pdserve", "--log-level", log_level, *args]
        self.argv += ["--port", "0"]
        self.child: Child | None = None
        self.url = ""
        self.exit_timeout_s = EXIT_TIMEOUT_S

    def __enter__(self) -> Pdserve:
        try:
            self._start()
        except BaseException:  # also Ctrl-C or SIGTERM while it starts: stop what started
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        (self.log_dir / "cluster.json").unlink(missing_ok=True)  # an older run's pids: not ours
        self.child = Child("pdserve", self.argv, self.log_dir / "stdout.log")
        self.child.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while not self.child.check_ready():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{' '.join(self.argv)} printed no READY line in time")
                time.sleep(POLL_S)
        except (ChildFailed, RuntimeError) as e:
            raise RuntimeError(f"{e}; see {self.log_dir}:\n{self.child.log_tail()}") from e
        self.url = str(self.child.url)

    def __exit__(self, *exc: object) -> None:
        if self.child is None:
            return
        cluster = [int(p["pid"]) for p in self.table()]  # read while the launcher still runs
        self.child.stop(STOP_TIMEOUT_S)
        stop_leftovers(cluster, self.exit_timeout_s)

    def table(self) -> list[dict[str, Any]]:
        """`launch`'s process table (name, pid, url of each process); empty for `serve`."""
        path = self.log_dir / "cluster.json"
        return json.loads(path.read_text())["processes"] if path.exists() else []


def stop_leftovers(pids: list[int], exit_timeout_s: float) -> list[int]:
    """Wait (bounded) for those of `pids` that are pdserve processes to exit (a pid that is
    someone else's by now is not waited for), SIGKILL the ones still running and wait for
    them to be gone (`runtime/pids.py`: through a pidfd, never a pid that changed hands).
    Returns the pdserve processes that survived it all."""
    left = wait_gone([p for p in pids if is_pdserve(p)], exit_timeout_s)
    return wait_gone([p for p in left if signal_pdserve(p, signal.SIGKILL)], GONE_TIMEOUT_S)


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


def engine_pid(worker_url: str, key_file: Path) -> int | None:
    """The worker's engine process as its /info tells it (None: the engine runs in the worker);
    /info asks for the cluster key `launch` wrote."""
    req = urllib.request.Request(
        worker_url + "/info", headers=ClusterKey.load(key_file).http_headers
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        pid = json.loads(r.read()).get("engine_pid")
    return int(pid) if pid is not None else None
