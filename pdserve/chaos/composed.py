"""A cluster chaos starts process by process, for faults that only one worker may carry.

`pdserve launch` gives every child the same environment and flags; a scenario that stalls one
worker's thread (PDSERVE_FAULTS in that process only), or runs one worker at `--tp 2`, needs
its own. ComposedCluster starts the workers (`pdserve serve --role ...`, named like launch
names them: prefill-0, decode-0, or colocated-0 without prefill workers) with their own
environment and arguments, waits for every READY line (bounded), then starts the router over
them. Every child logs to its own file (no pipe to block on) and dies with us (PDEATHSIG);
each pid goes to LOG_DIR/composed.json as it starts (a test kills what is left of them);
`close()` stops them by pid: router first, SIGTERM, a bound, then SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pdserve.chaos.cluster import Cluster, ClusterError, ClusterSpec, new_cluster_key
from pdserve.engine_flags import engine_process_argv
from pdserve.runtime.child import _die_with_parent

STOP_S = 15.0  # per group: a worker's drain and its supervisor's 5 s thread bound fit in it


class _Proc:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        with open(log, "wb") as out:
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent(),
            )
        self.url: str | None = None

    def ready(self) -> bool:
        """True once its READY line is logged; ClusterError if it exited instead."""
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("READY "):
                self.url = line.split()[1].rstrip("/")
                return True
        if self.popen.poll() is not None:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
            raise ClusterError(f"{self.name} exited with {self.popen.returncode}:\n{tail}")
        return False

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def reap(self, timeout_s: float) -> None:
        """Wait for it to exit after terminate(); SIGKILL it past the bound."""
        try:
            self.popen.wait(max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)


class ComposedCluster(Cluster):
    launched = True

    def __init__(self, spec: ClusterSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[_Proc] = []  # workers, then the router

    def start(self) -> ComposedCluster:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        s = self.spec
        deadline = time.monotonic() + s.startup_timeout_s
        base = {**os.environ, **dict(s.env), "PYTHONUNBUFFERED": "1"}
        key = ["--cluster-key-file", str(new_cluster_key(self.log_dir))]
        names = [f"prefill-{i}" for i in range(s.prefill)]
        names += [f"{'decode' if s.prefill else 'colocated'}-{i}" for i in range(s.decode)]
        for name in names:
            role = name.split("-")[0]
            own = {k: v for n, k, v in s.worker_env if n == name}
            # A fault's warning logged from another thread can split the READY line, so a
            # worker that carries faults logs errors only.
            level = "ERROR" if own else "WARNING"
            argv = [sys.executable, "-m", "pdserve", "--log-level", level, "serve"]
            argv += ["--role", role, "--host", "127.0.0.1", "--port", "0", "--model", s.model]
            argv += ["--backend", s.backend, "--threads", str(s.threads), *key]
            argv += ["--control-port", "0"] if role == "prefill" else []
            argv += engine_process_argv(s.engine_process)
            argv += [a for n, args in s.worker_args if n == name for a in args]
            self._add(_Proc(name, argv, {**base, **own}, self.log_dir / f"{name}.log"))
        self._barrier(self.procs, deadline)
        workers = list(self.procs)
        argv = [sys.executable, "-m", "pdserve", "--log-level", "WARNING", "router"]
        argv += ["--decode", *(str(p.url) for p in workers if not p.name.startswith("prefill"))]
        if s.prefill:
            argv += ["--prefill", *(str(p.url) for p in workers if p.name.startswith("prefill"))]
        argv += ["--model", s.model, "--host", "127.0.0.1", "--port", "0", *key]
        router = _Proc("router", argv, base, self.log_dir / "router.log")
        self._add(router)
        self._barrier([router], deadline)
        self.url = str(router.url)
        self.names = {p.name: str(p.url) for p in workers}

    def _add(self, proc: _Proc) -> None:
        """Keep it, and name every pid so far in LOG_DIR/composed.json (renamed over)."""
        self.procs.append(proc)
        rows = [{"name": p.name, "pid": p.popen.pid, "log": str(p.log)} for p in self.procs]
        table = self.log_dir / "composed.json"
        tmp = table.with_name(table.name + ".tmp")
        tmp.write_text(json.dumps({"harness_pid": os.getpid(), "processes": rows}, indent=1))
        os.replace(tmp, table)

    def exit_code(self, pid: int) -> int | None:
        """A worker's exit status, once it exited (this process is its parent)."""
        proc = next((p.popen for p in self.procs if p.popen.pid == pid), None)
        return None if proc is None else proc.poll()

    def _barrier(self, procs: list[_Proc], deadline: float) -> None:
        while not all([p.ready() for p in procs]):  # a list: look at every one each time
            if time.monotonic() > deadline:
                late = ", ".join(p.name for p in procs if p.url is None)
                raise ClusterError(f"{late} printed no READY within {self.spec.startup_timeout_s}s")
            time.sleep(0.1)

    def close(self) -> None:
        # The router first, so that no request reaches a worker that is going away.
        router = [p for p in self.procs if p.name == "router"]
        for group in (router, [p for p in self.procs if p.name != "router"]):
            for p in group:
                p.terminate()
            deadline = time.monotonic() + STOP_S
            for p in group:
                p.reap(deadline - time.monotonic())
