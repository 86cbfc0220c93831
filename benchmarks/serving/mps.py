"""*module*: a private CUDA MPS daemon for one benchmark cluster, stopped by its pid.

Without MPS the processes sharing one GPU (a 1P+1D cluster's two engines) time-slice it: D's
decode graph waits for P's prompt kernels to finish their slice. Under MPS their kernels run side
by side on the SMs. The daemon here is this benchmark's own (its pipe and log folders are private,
under the run's output folder), so nothing outside the cluster connects to it, and the card's
settings (compute mode and the rest) are left as they are.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"


@contextlib.contextmanager
def private_mps(folder: Path, timeout: float = 30.0) -> Iterator[dict[str, str]]:
    """Start MPS's control daemon in the foreground; yield the env its clients need."""
    exe = shutil.which(CONTROL)
    if exe is None:
        raise RuntimeError(f"{CONTROL} is not on PATH: MPS cannot run on this machine")
    pipe, log = folder / "mps-pipe", folder / "mps-log"
    pipe.mkdir(parents=True, exist_ok=True)
    log.mkdir(parents=True, exist_ok=True)
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log)}
    daemon = subprocess.Popen(
        [exe, "-f"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + timeout
        while not (pipe / "control").exists():
            if daemon.poll() is not None:
                raise RuntimeError(f"{CONTROL} exited {daemon.returncode}: see {log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{CONTROL} made no control pipe in {timeout:.0f} s")
            time.sleep(0.1)
        yield env
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run([exe], input=b"quit\n", env=env, timeout=timeout, check=False)
        try:
            daemon.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=timeout)
