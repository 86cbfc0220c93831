"""A cluster's own CUDA MPS daemon (`pdserve launch --mps`): workers that share a GPU run their
kernels side by side instead of in time slices.

Without MPS, the processes on one GPU take turns: a decode worker's step waits while a prefill
worker's prompt kernels hold their slice. Under MPS one server runs every client's kernels on
the SMs at once (benchmarks/RESULTS.md measures what that gives 1P+1D on one GPU). The daemon
here is the cluster's alone: its pipe and log folders are under the launch's log folder, so only
the workers the launcher starts (given CUDA_MPS_PIPE_DIRECTORY) connect to it; the card's own
settings (compute mode and the rest) are left as they are. It is started before the workers
and stopped after them: `quit` on its control pipe (the server goes once its clients have),
then SIGTERM and SIGKILL by pid, as for any child (runtime/child.py), so it dies with the
launcher too.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from pdserve.runtime.child import Child, ChildFailed

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
POLL_S = 0.05


class MpsDaemon:
    """MPS's control daemon in the foreground (`-f`), one per launched cluster."""

    def __init__(self, folder: Path, exe: str | None = None) -> None:
        """`folder`: where its pipe and log folders go; `exe`: the control program (default:
        nvidia-cuda-mps-control on PATH)."""
        self.exe = exe or shutil.which(CONTROL)
        self.pipe = folder / "mps-pipe"
        self.logs = folder / "mps-log"
        self.child: Child | None = None

    @property
    def env(self) -> dict[str, str]:
        """What a client needs to reach this daemon (and no other)."""
        return {PIPE_ENV: str(self.pipe), LOG_ENV: str(self.logs)}

    def start(self, timeout_s: float) -> dict[str, str]:
        """Start the daemon and wait for its control pipe; the clients' env. Raises
        ChildFailed, naming why, if it cannot run or does not come up within `timeout_s`."""
        if self.exe is None:
            raise ChildFailed(f"--mps: {CONTROL} is not on PATH, so MPS cannot run here")
        self.pipe.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.child = Child("mps", [self.exe, "-f"], self.logs / "daemon.out", self.env)
        self.child.start()
        deadline = time.monotonic() + timeout_s
        while not (self.pipe / "control").exists():
            code = self.child.poll()
            if code is not None:
                raise ChildFailed(f"{CONTROL} exited {code} before it listened", self.child)
            if time.monotonic() > deadline:
                self.stop(timeout_s)
                raise ChildFailed(f"{CONTROL} made no control pipe within {timeout_s:.0f}s")
            time.sleep(POLL_S)
        log.info("MPS daemon (pid %d) serves the workers: pipe %s", self.child.pid, self.pipe)
        return self.env

    def stop(self, timeout_s: float) -> bool:
        """Ask the daemon to quit, then SIGTERM and SIGKILL by pid; True if it needed SIGKILL.
        Call once the clients are gone (the server waits for them)."""
        child = self.child
        if child is None or child.poll() is not None:
            return False
        assert self.exe is not None  # a started daemon has one
        try:
            env = {**os.environ, **self.env}
            subprocess.run(  # its answer stays off our stdout (READY lines go there)
                [self.exe],
                input=b"quit\n",
                stdout=subprocess.DEVNULL,
                env=env,
                timeout=timeout_s,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("MPS daemon: quit failed (%s); stopping it by signal", e)
        deadline = time.monotonic() + timeout_s
        if child.wait(timeout_s) is not None:
            return False
        child.signal(signal.SIGTERM)
        if child.wait(max(0.0, deadline - time.monotonic()) + 1.0) is not None:
            return False
        log.error("MPS daemon (pid %d) did not stop; SIGKILL", child.pid)
        child.kill()
        return True
