"""Processes known only by their pid: is one still running, is it ours, signal it, wait for it.

The launcher's cluster table (cluster.json), a router's /debug/cluster and a chaos client's
progress file name processes by pid; whoever stops a cluster (the chaos harness, the tests,
the benchmarks) holds no Popen handle for most of them. A pid is only a number the kernel
hands out again once its process is reaped, so:

* `pid_alive` reads /proc/PID/stat, and a zombie (exited, not yet reaped) counts as gone:
  it holds no resources and no signal can reach it.
* `is_pdserve` reads /proc/PID/cmdline: a pid that is someone else's by now is never ours.
  A pid that is another pdserve process's by now (another test's server) is told apart by a
  caller's `expect`: a test of the arguments that only the process meant carries (the rank of
  one worker: `--parent PID`; a path under one run's own directory).
* `signal_pdserve` opens a pidfd *before* those checks and signals through it, so a pid that
  changes hands between the check and the signal is never hit: the pidfd still names the
  process that had it, which is then gone.
* `wait_gone` is always bounded, and sleeps on the processes' pidfds (readable once each has
  exited) instead of polling /proc.

Linux only (/proc and pidfds, kernel 5.3 or later), as is the rest of the process handling.
Imports no other pdserve package (runtime/ is layer 0).
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Callable, Iterable

# A pid whose pidfd cannot be opened (not a process leader, say) is polled this often instead.
POLL_S = 0.05


def pid_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):  # gone, or going while read
        return False
    return state not in ("Z", "X")


def cmdline(pid: int) -> list[str]:
    """`pid`'s arguments; [] once it is gone (a zombie's command line is empty too)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    args = raw.split(b"\0")
    if args[-1] == b"":  # each argument ends with a NUL (unless a process rewrote them)
        args.pop()
    return [os.fsdecode(a) for a in args]


def is_pdserve(pid: int) -> bool:
    """True if `pid` runs pdserve: one of its arguments is the package, a module of it, or the
    `pdserve` script (`python -m pdserve ...`, `-m pdserve.chaos.client`, `.../bin/pdserve`).

    Judged per argument by its last path component, so a stranger that merely names a file
    under a `pdserve/` directory (an editor, a grep) is not taken for ours. A zombie has an
    empty command line: not ours to signal."""
    return any(os.path.basename(a).startswith("pdserve") for a in cmdline(pid))


def signal_pdserve(
    pid: int, sig: signal.Signals, expect: Callable[[list[str]], bool] | None = None
) -> bool:
    """Send `sig` to `pid` if it is a pdserve process (and, given `expect`, its arguments pass
    that test), through a pidfd taken before the checks. True if the signal was sent; False if
    the process is gone or is not the one meant; ValueError for 0 or a negative number (to
    kill(2) they mean a whole process group, or everyone)."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise ValueError(f"not a process id: {pid!r}")
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if not is_pdserve(pid) or (expect is not None and not expect(cmdline(pid))):
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:  # exited between the check and the signal
        return False
    finally:
        os.close(fd)


def wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait at most `timeout_s` until none of `pids` runs; returns those still running (in the
    order given), so `[]` means all are gone."""
    pids = list(pids)
    deadline = time.monotonic() + max(timeout_s, 0.0)
    fds: dict[int, int] = {}  # pidfd -> pid
    polled: list[int] = []  # pids without a pidfd: checked through /proc every POLL_S
    try:
        for pid in pids:
            try:
                fds[os.pidfd_open(pid)] = pid
            except ProcessLookupError:
                pass  # already reaped: gone
            except OSError:  # not a process leader, or not a pid at all (0, -1): ask /proc
                polled.append(pid)
        still = _wait(fds, polled, deadline)
    finally:
        for fd in fds:
            os.close(fd)
    return [p for p in pids if p in still]


def _wait(fds: dict[int, int], polled: list[int], deadline: float) -> set[int]:
    """The pids of `fds` and `polled` still running at `deadline`, or none before it."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)  # readable once that process has exited
    running = set(fds)
    while True:
        polled = [p for p in polled if pid_alive(p)]
        remaining = deadline - time.monotonic()
        wait_s = max(min(remaining, POLL_S) if polled else remaining, 0.0)
        if running:  # even past the deadline: a timeout of 0 still looks once
            for fd, _ in poller.poll(wait_s * 1000):
                running.discard(fd)
                poller.unregister(fd)
        if (not running and not polled) or remaining <= 0:
            return {fds[fd] for fd in running} | set(polled)
        if not running:
            time.sleep(wait_s)
