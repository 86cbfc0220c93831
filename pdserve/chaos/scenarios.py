"""What every chaos scenario shares: its options, its context, its outcome, the registry.

A scenario names the cluster it needs (`spec`), says whether an existing cluster fits it
(`unfit`), and runs against a Context: the cluster, a seeded random generator of its own,
a work directory and a progress line printer. It returns an Outcome: the violations it saw
(any violation fails the run), one record per round, and a summary of the figures.
A destructive scenario (it kills a worker) gets a cluster of its own when chaos launches
them, and is never followed by another scenario on the same cluster. A scenario whose
faults live in a process's environment needs chaos to start the cluster (`needs_launch`);
one that needs several clusters starts them through `Context.launch`.
"""

from __future__ import annotations

import math
import random
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pdserve.chaos.cluster import Cluster, ClusterError, ClusterSpec, WorkerRef
from pdserve.chaos.load import LoadSpec


@dataclass(frozen=True)
class ChaosOptions:
    rounds: int = 3
    seed: int = 0
    sessions: int = 60
    kill_after: tuple[float, float] = (2.0, 25.0)  # seconds of load before the kill
    prefill: int = 1
    decode: int = 1
    backend: str = "shm"
    model: str = "builtin:tiny"
    threads: int = 1
    engine_process: bool | None = None  # every launched worker's --engine-process (None: serve's)
    max_tokens: int = 16  # per chat turn: small, so that sessions take many turns
    abandon: float = 0.1  # chance a client closes a stream mid-way (aborts during the load)
    request_timeout_s: float = 15.0  # each load request's own timeout: bounds fences too
    deep_bound_s: float = 2.0  # the abort storm: kill -> passing deep health
    quiet_bound_s: float = 30.0  # fault -> every worker's invariants hold
    # Last round tokens/s over the first round: a storm elsewhere left a fifteenth (LESSONS #8);
    # a shared 2-core box alone swings 2x, so the bound sits between the two.
    min_throughput_ratio: float = 0.25
    steady_s: float = 10.0  # abort-storm: a steady load this long before and after (0: off)
    # message-faults: the control messages dropped in turn, one cluster each
    messages: tuple[str, ...] = ("PrefillAccept", "PrefillDone", "AbortAck", "KVChunk")
    requests: int = 2000  # fuzz: seeded cases per run
    resets: int = 3000  # early-reset: connections reset per storm (per target and round)
    reset_bound_s: float = 2.0  # early-reset: the storm's last reset -> every worker quiet
    fresh_bound_s: float = 1.0  # early-reset: a fresh request after the storm answers within

    def __post_init__(self) -> None:
        lo, hi = self.kill_after
        if not 0 < lo <= hi:
            raise ValueError(f"--kill-after needs 0 < MIN <= MAX, got {lo}:{hi}")
        if not self.messages:
            raise ValueError("--messages needs at least one message type")
        if self.requests < 1 or self.resets < 1:
            raise ValueError("need --requests >= 1 and --resets >= 1")
        if self.rounds < 1 or self.sessions < 1 or self.prefill < 0 or self.decode < 1:
            raise ValueError("need --rounds >= 1, --sessions >= 1, --prefill >= 0, --decode >= 1")

    def base_spec(self) -> ClusterSpec:
        return ClusterSpec(self.prefill, self.decode, self.backend, self.model, self.threads)

    def load(self, seed: int, duration_s: float | None = None, abandon: float = 0.0) -> LoadSpec:
        """The chaos client's load for these options: `--sessions` chats of `--max-tokens`."""
        return LoadSpec(
            self.sessions,
            seed=seed,
            max_tokens=self.max_tokens,
            timeout_s=self.request_timeout_s,
            abandon=abandon,
            duration_s=duration_s,
        )


@dataclass
class Outcome:
    name: str
    cluster: str = ""
    skipped: str | None = None  # why it did not run (not a failure)
    violations: list[str] = field(default_factory=list)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    diagnosis: list[str] = field(default_factory=list)  # doctor's words after a violation
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations

    def violate(self, message: str) -> None:
        self.violations.append(message)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "skipped": self.skipped,
            "cluster": self.cluster,
            "duration_s": round(self.duration_s, 3),
            "violations": self.violations,
            "summary": self.summary,
            "rounds": self.rounds,
            "diagnosis": self.diagnosis,
        }


@dataclass
class Context:
    opts: ChaosOptions
    shared: Cluster | None  # the scenario's cluster; None for one that starts its own
    work_dir: Path
    rng: random.Random
    say: Callable[[str], None]  # one progress line (to stderr)
    launch: Callable[[ClusterSpec], Cluster]  # start another cluster; the caller closes it

    @property
    def cluster(self) -> Cluster:
        if self.shared is None:
            raise ClusterError("this scenario has no shared cluster; it starts its own")
        return self.shared

    def workers(self, role: str | None = None) -> list[WorkerRef]:
        return [w for w in self.cluster.workers() if role is None or w.role == role]

    def diagnose(self, cluster: Cluster | None = None) -> list[str]:
        """Doctor's reading of the cluster, for the report of a scenario that failed."""
        from pdserve.doctor.diagnosis import diagnose

        try:
            return diagnose((cluster or self.cluster).document(), time.time()).lines()
        except ClusterError as e:
            return [f"doctor could not read the cluster: {e}"]


def scenario_rng(seed: int, name: str) -> random.Random:
    """A generator per scenario: adding a scenario does not change the others' draws."""
    return random.Random(seed * 7919 + zlib.crc32(name.encode()))


class Scenario(Protocol):
    name: str
    destructive: bool  # it kills or wedges part of the cluster
    needs_launch: bool  # its faults go into a cluster's environment: never with --url

    def spec(self, opts: ChaosOptions) -> ClusterSpec | None:
        """The cluster this scenario wants when chaos launches one; None: it starts its own."""
        ...

    def unfit(self, workers: list[WorkerRef]) -> str | None:
        """Why it cannot run on a cluster with these workers, or None."""
        ...

    def run(self, ctx: Context, out: Outcome) -> None:
        """Run every round, recording violations, rounds and the summary into `out`."""
        ...


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]
