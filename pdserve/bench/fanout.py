"""`pdserve bench --processes N`: one run's requests sent from N client processes.

Why: one Python client reads every stream's chunks on one event loop. At concurrency 128 that
is tens of thousands of SSE events a second, more than one process keeps up with
(benchmarks/RESULTS.md, 2026-12-03), and a client that falls behind times chunks as it gets
to them, not as they arrived: the ITL it reports would be its own.

How: the requests are made once, here, and dealt round robin (request i to process i mod N);
each process takes an equal share of --max-concurrency and of --request-rate (a Poisson
stream split at random stays Poisson at the share of the rate), warms up on its own
connections, and then waits at one barrier, so that every process's clock starts together.
Each sends back its records; the run's records are theirs, each start moved onto the common
clock (the processes' wall-clock starts, a millisecond or so apart), indices back to the
requests' own, and the summary is computed over all of them as for one process. A process
that fails fails the run.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdserve.bench.config import ArrivalConfig, ClientConfig, Slo
from pdserve.bench.dataset import BenchRequest
from pdserve.bench.metrics import summarize_run
from pdserve.bench.record import RequestRecord, record_from_json
from pdserve.bench.runner import RunResult, Workload, run_workloads

MAX_PROCESSES = 64
START_TIMEOUT_S = 120.0  # for every process to import, connect and warm up
END_GRACE_S = 60.0  # past the run's own bound, before a silent process is given up on


@dataclass(frozen=True)
class Shard:
    """What one client process sends: its requests (with their indices in the run) and its
    share of the arrivals."""

    index: int
    requests: tuple[BenchRequest, ...]
    positions: tuple[int, ...]  # each request's index in the whole run
    arrival: ArrivalConfig


def split(requests: Sequence[BenchRequest], arrival: ArrivalConfig, n: int) -> list[Shard]:
    """Request i to shard i mod n; each shard its share of the concurrency cap and rate."""
    if not 1 <= n <= min(MAX_PROCESSES, max(1, len(requests))):
        raise ValueError(
            f"--processes must be in [1, {min(MAX_PROCESSES, max(1, len(requests)))}] "
            f"(at most one per request), got {n}"
        )
    cap = arrival.max_concurrency
    if cap is not None and cap < n:
        raise ValueError(f"--max-concurrency {cap} cannot be shared by {n} processes")
    shards = []
    for i in range(n):
        share = None if cap is None else cap // n + (i < cap % n)
        rate = arrival.request_rate / n if math.isfinite(arrival.request_rate) else math.inf
        positions = tuple(range(i, len(requests), n))
        shards.append(
            Shard(
                i,
                tuple(requests[p] for p in positions),
                positions,
                replace(arrival, request_rate=rate, max_concurrency=share),
            )
        )
    return shards


def _run_shard(
    shard: Shard,
    client: ClientConfig,
    slo: Slo,
    warmup: int,
    seed: int,
    barrier: Any,
    results: Any,
) -> None:
    """In a client process: run the shard, put (index, result or None, error) on `results`."""
    from pdserve.runtime import evloop

    def gate() -> None:
        barrier.wait(START_TIMEOUT_S)

    try:
        workload = Workload("main", shard.requests, shard.arrival, seed=seed + shard.index)
        run = evloop.run(run_workloads(client, [workload], slo, warmup, shard.index == 0, gate))
        payload = {
            "records": [r.as_json() for r in run.records],
            "duration_s": run.duration_s,
            "started_at": run.started_at,
            "model": run.model,
            "warmup_errors": run.warmup_errors,
        }
        results.put((shard.index, payload, None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the run
        barrier.abort()
        results.put((shard.index, None, f"{type(e).__name__}: {e}"))


def run_processes(
    client: ClientConfig,
    requests: Sequence[BenchRequest],
    arrival: ArrivalConfig,
    slo: Slo,
    warmup: int,
    seed: int,
    processes: int,
) -> RunResult:
    """The run of `requests` from `processes` client processes, as one RunResult."""
    shards = split(requests, arrival, processes)
    ctx = mp.get_context("spawn")  # a clean interpreter: no inherited event loop or threads
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [
        ctx.Process(
            target=_run_shard,
            args=(s, client, slo, warmup, seed, barrier, results),
            name=f"bench-{s.index}",
            daemon=True,
        )
        for s in shards
    ]
    for p in procs:
        p.start()
    # Every request is bounded by the client's timeout; a run cannot last longer than all of
    # them one after another.
    bound = START_TIMEOUT_S + (len(requests) + warmup) * client.request_timeout_s + END_GRACE_S
    deadline = time.monotonic() + bound
    got: dict[int, dict[str, Any]] = {}
    try:
        while len(got) < processes:
            try:
                index, payload, error = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"client process {', '.join(dead) or 'results'} "
                        f"{'died' if dead else 'never came'}"
                    ) from None
                continue
            if error is not None:
                raise RuntimeError(f"client process bench-{index} failed: {error}")
            got[index] = payload
    finally:
        for p in procs:
            p.join(10.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
    return merge(shards, [got[s.index] for s in shards], slo)


def merge(shards: Sequence[Shard], payloads: Sequence[dict[str, Any]], slo: Slo) -> RunResult:
    """The processes' results as one run on the clock of the first to start."""
    t0 = min(p["started_at"] for p in payloads)
    records: list[RequestRecord] = []
    duration = 0.0
    for shard, p in zip(shards, payloads, strict=True):
        offset = p["started_at"] - t0
        duration = max(duration, offset + p["duration_s"])
        for d in p["records"]:
            rec = record_from_json(d)
            rec.start += offset
            rec.index = shard.positions[rec.index]
            records.append(rec)
    records.sort(key=lambda r: r.start)
    warm = [e for p in payloads for e in p["warmup_errors"]]
    result = RunResult(records, duration, payloads[0]["model"], t0, warmup_errors=warm)
    result.summary = summarize_run(records, duration, slo)
    return result
