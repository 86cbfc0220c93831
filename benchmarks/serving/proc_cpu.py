"""CPU time of a running process from /proc, its main thread apart from the rest.

For a Python server the main thread is its asyncio loop (HTTP, streaming) and the other
threads are the engine's and torch's: how much of a core each side uses while a benchmark
streams tokens tells whether the serving path's host side, not the GPU, sets the pace
(benchmarks/serving/serving_overhead.py, benchmarks/serving/gpu_serving.py). Linux only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Cpu:
    main_s: float  # the process's main thread
    other_s: float  # every other thread
    kernel_s: float  # of the total, in the kernel (stime: socket calls, wake-ups)

    def __sub__(self, before: Cpu) -> Cpu:
        return Cpu(
            self.main_s - before.main_s,
            self.other_s - before.other_s,
            self.kernel_s - before.kernel_s,
        )

    @property
    def total_s(self) -> float:
        return self.main_s + self.other_s


def _stat_cpu_s(path: str) -> tuple[float, float]:
    """(utime + stime, stime) of a /proc stat file, in seconds (the command name may hold
    spaces)."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    user, system = int(fields[11]), int(fields[12])
    return (user + system) / TICKS, system / TICKS


def read_cpu(pid: int) -> Cpu:
    """A process's CPU time so far, its main thread apart (threads that ended are lost; the
    processes measured here keep theirs for their whole life)."""
    main = other = kernel = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            s, k = _stat_cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended between the listing and the read
        kernel += k
        if int(tid) == pid:
            main += s
        else:
            other += s
    return Cpu(main, other, kernel)


def children(pid: int) -> list[int]:
    """The pids of a process's children (a router of several processes: router/pool.py)."""
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass  # it ended
    return kids


def read_tree_cpu(pid: int) -> Cpu:
    """`read_cpu` of a process plus its children's (each child's main thread counted as
    main): a router's processes together."""
    total = read_cpu(pid)
    for kid in children(pid):
        try:
            c = read_cpu(kid)
        except (FileNotFoundError, ProcessLookupError):
            continue
        total = Cpu(total.main_s + c.main_s, total.other_s + c.other_s, total.kernel_s + c.kernel_s)
    return total
