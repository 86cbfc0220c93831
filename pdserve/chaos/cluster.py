"""The cluster a chaos run works on: one it launches itself, or one it is pointed at.

* LaunchedCluster runs `pdserve launch` as our child (its stdout to a log file, so it can
  never block on a pipe), waits for READY with a bound, reads LOG_DIR/cluster.json for the
  pids, and on `close()` stops the launcher by pid (SIGTERM, a bound, SIGKILL) and then
  SIGKILLs, by pid, any child of it still running: a chaos run leaves no process behind.
* AttachedCluster is a router URL. It only speaks HTTP; the pids it needs to kill come from
  the router's /debug/cluster, and it refuses to kill one that is not a pdserve process on
  this machine.
Both answer `workers()` from /debug/cluster, so scenarios never care which one they have.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.engine_flags import engine_process_argv
from pdserve.runtime import httpcall
from pdserve.runtime.child import _die_with_parent
from pdserve.runtime.cluster_key import generate as generate_key
from pdserve.runtime.pids import is_pdserve, signal_pdserve, wait_gone

DEBUG_TIMEOUT_S = 10.0  # /debug/cluster asks every worker, each bounded by 3 s
STOP_S = 45.0  # the launcher stops its router, then its workers, 30 s each at worst
ENGINE_GONE_S = 10.0  # a killed worker's engine process dies with it (PR_SET_PDEATHSIG)


class ClusterError(RuntimeError):
    """The cluster could not be started or read; the message says which and why."""


@dataclass(frozen=True)
class ClusterSpec:
    prefill: int
    decode: int
    backend: str = "shm"
    model: str = "builtin:tiny"
    threads: int = 1
    env: tuple[tuple[str, str], ...] = ()  # extra environment for every process (faults)
    # (worker name as launch names it, e.g. "prefill-0", variable, value): one worker only.
    # `pdserve launch` cannot do that, so such a cluster is composed (tools/composed.py).
    worker_env: tuple[tuple[str, str, str], ...] = ()
    # (worker name, arguments added to its `serve`): e.g. one worker at --tp 2; composed too.
    worker_args: tuple[tuple[str, tuple[str, ...]], ...] = ()
    startup_timeout_s: float = 180.0
    debug_faults: bool = False  # workers take fault points at run time (POST /debug/faults)
    # Every worker's engine in a process of its own, or not (None: serve's default, on for CUDA).
    engine_process: bool | None = None

    def describe(self) -> str:
        faults = dict(self.env).get("PDSERVE_FAULTS")
        extra = f", faults {faults}" if faults else ""
        extra += "".join(f", {n}: {k}={v}" for n, k, v in self.worker_env)
        extra += "".join(f", {n}: {' '.join(a)}" for n, a in self.worker_args)
        extra += ", run-time faults" if self.debug_faults else ""
        extra += {None: "", True: ", engine processes", False: ", engines in-process"}[
            self.engine_process
        ]
        workers = f"{self.prefill}P+{self.decode}D" if self.prefill else f"{self.decode} co-located"
        return f"{workers} {self.backend} {self.model}{extra}"


@dataclass(frozen=True)
class WorkerRef:
    url: str
    role: str  # prefill | decode (the router's view: decode includes co-located)
    pid: int | None
    identity: str | None  # the control-plane identity (peers name each other by it)
    control: str | None  # a prefill worker's control address
    healthy: bool = True  # the router's last liveness check passed
    engine_pid: int | None = None  # its engine process (`serve --engine-process`), if any


class Cluster:
    url: str = ""
    launched = False  # we started it, and stop it
    names: dict[str, str] = {}  # launch's worker names (prefill-0, ...) -> URL, when known

    def document(self) -> dict[str, Any]:
        """The router's /debug/cluster; ClusterError if the router does not answer."""
        r = httpcall.get(self.url + "/debug/cluster", DEBUG_TIMEOUT_S)
        if not r.ok or not isinstance(r.body, dict):
            raise ClusterError(f"GET {self.url}/debug/cluster: {r.error or r.status}")
        return r.body

    def workers(self) -> list[WorkerRef]:
        out = []
        for w in self.document()["router"]["workers"]:
            info = w.get("info") or {}
            out.append(
                WorkerRef(
                    w["url"],
                    w["role"],
                    w.get("pid"),
                    info.get("identity"),
                    info.get("control"),
                    bool(w.get("healthy")),
                    info.get("engine_pid"),
                )
            )
        return out

    def send_signal(self, w: WorkerRef, sig: signal.Signals) -> float:
        """Send `sig` to a worker by its pid (checked to be ours); the monotonic time sent. A
        worker stopped or resumed is both of its processes: its engine process too."""
        t = time.monotonic()
        given = [w.pid]
        if sig in (signal.SIGSTOP, signal.SIGCONT) and w.engine_pid is not None:
            given.append(w.engine_pid)
        pids: list[int] = []
        for pid in given:  # every one checked before any is signalled
            if not (isinstance(pid, int) and pid > 0 and is_pdserve(pid)):
                raise ClusterError(f"worker {w.url}: pid {pid} is not a pdserve process here")
            pids.append(pid)
        sent: list[int] = []
        for pid in pids:
            if not signal_pdserve(pid, sig):  # gone since the check
                if sig == signal.SIGSTOP:  # leave nothing of the worker half stopped
                    for done in sent:
                        signal_pdserve(done, signal.SIGCONT)
                raise ClusterError(f"worker {w.url}: pid {pid} exited before {sig.name}")
            sent.append(pid)
        return t

    def kill(self, w: WorkerRef) -> float:
        """SIGKILL a worker by its pid; the monotonic time of the kill."""
        t = self.send_signal(w, signal.SIGKILL)
        assert w.pid is not None  # send_signal() checked it
        if wait_gone([w.pid], 10.0):
            raise ClusterError(f"worker {w.url} (pid {w.pid}) survived SIGKILL for 10 s")
        if w.engine_pid is not None and wait_gone([w.engine_pid], ENGINE_GONE_S):
            raise ClusterError(
                f"worker {w.url}'s engine process outlived it for {ENGINE_GONE_S:.0f} s"
            )
        return t

    def close(self) -> None:
        """Stop what we started; nothing for a cluster we were only pointed at."""

    def exit_code(self, pid: int) -> int | None:
        """A worker's exit status if this cluster saw it exit; None when it cannot tell."""
        return None


def new_cluster_key(log_dir: Path) -> Path:
    """A fresh key for a cluster the harness starts (LOG_DIR/cluster.key); the harness uses it
    from now on, to read the workers' /debug/* and set their fault points."""
    key_file = log_dir / "cluster.key"
    key_file.unlink(missing_ok=True)
    httpcall.use_key(generate_key(key_file))
    return key_file


class AttachedCluster(Cluster):
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.document()  # fail now, not in the middle of a scenario


class LaunchedCluster(Cluster):
    launched = True

    def __init__(self, spec: ClusterSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / "launcher.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids: list[int] = []  # the launcher's children, from cluster.json

    def exit_code(self, pid: int) -> int | None:
        """From the launcher's log: it reports every worker that exits while it runs."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return None
        m = re.search(rf"\(pid {pid}\) exited unexpectedly with code (-?\d+)", text)
        return int(m.group(1)) if m else None

    def start(self) -> LaunchedCluster:
        s = self.spec
        argv = [sys.executable, "-m", "pdserve", "--log-level", "WARNING", "launch"]
        argv += ["--model", s.model, "--prefill", str(s.prefill), "--decode", str(s.decode)]
        argv += ["--backend", s.backend, "--threads", str(s.threads), "--port", "0"]
        argv += ["--on-worker-exit", "continue", "--log-dir", str(self.log_dir)]
        argv += ["--startup-timeout", str(s.startup_timeout_s)]
        argv += ["--cluster-key-file", str(new_cluster_key(self.log_dir))]
        if s.debug_faults:
            argv.append("--debug-faults")
        argv += engine_process_argv(s.engine_process)
        env = {**os.environ, **dict(s.env), "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent(),  # a SIGKILLed chaos run leaves no cluster
            )
        try:
            self._wait_ready(time.monotonic() + s.startup_timeout_s + 10.0)
        except BaseException:
            self.close()
            raise
        return self

    def _wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        while True:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith("READY "):
                    self.url = line.split()[1].rstrip("/")
                    table = json.loads((self.log_dir / "cluster.json").read_text())
                    self.pids = [p["pid"] for p in table["processes"]]
                    self.names = {p["name"]: p["url"] for p in table["processes"]}
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
                why = "exited" if self.proc.poll() is not None else "printed no READY in time"
                raise ClusterError(f"pdserve launch {why}; last lines:\n{tail}")
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        # The launcher's children die with it (PDEATHSIG); make sure, by pid.
        for pid in wait_gone(self.pids, 10.0):
            signal_pdserve(pid, signal.SIGKILL)
        wait_gone(self.pids, 10.0)
