"""Drive one or more workloads against a server and collect every request's record.

A workload is a list of requests with its own arrival process (rate, burstiness, cap on
requests in flight); several run side by side on one clock, which is how a mixed load (many
decoding streams plus a Poisson stream of long prompts) is built. Start offsets are drawn
before the run (arrival.py). With a concurrency cap a request waits for a free slot, so it
may start later than its offset: the offered load then adapts to the server (closed loop).

Nothing here can hang: every request has the client's whole-request timeout, the warm-up has
the same, and the run ends when every request has a record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.bench.arrival import schedule
from pdserve.bench.client import encode_body, send
from pdserve.bench.config import ArrivalConfig, ClientConfig, Slo
from pdserve.bench.dataset import BenchRequest
from pdserve.bench.metrics import summarize_run
from pdserve.bench.progress import Progress
from pdserve.bench.record import RequestRecord

log = logging.getLogger(__name__)

MODELS_TIMEOUT_S = 10.0
NO_SLO = Slo()


@dataclass(frozen=True)
class Workload:
    name: str
    requests: Sequence[BenchRequest]
    arrival: ArrivalConfig = ArrivalConfig()
    seed: int = 0  # of the arrival schedule


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float  # first send -> last request's end
    model: str | None
    started_at: float = 0.0  # the run's start on the wall clock (time.time())
    summary: dict[str, Any] = field(default_factory=dict)
    warmup_errors: list[str] = field(default_factory=list)
    # The router's PD block (bench/pd_routing.py), set by the command around the run.
    pd: dict[str, Any] | None = None


async def discover_model(session: aiohttp.ClientSession, url: str) -> str | None:
    """The first model of /v1/models, or None if the server does not say (it is optional)."""
    try:
        timeout = aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)
        async with session.get(url.rstrip("/") + "/v1/models", timeout=timeout) as resp:
            data = await resp.json(content_type=None)
        return str(data["data"][0]["id"])
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError) as e:
        log.warning("no model name from %s/v1/models (%s); sending none", url, e)
        return None


async def run_workloads(
    client: ClientConfig,
    workloads: Sequence[Workload],
    slo: Slo = NO_SLO,
    warmup: int = 1,
    progress: bool = True,
    start_gate: Callable[[], None] | None = None,
) -> RunResult:
    """`start_gate`: called (on a thread) after the warm-up, and the run's clock starts when
    it returns: how several client processes of one run start together (bench/fanout.py)."""
    caps = [w.arrival.max_concurrency for w in workloads]
    # aiohttp's default pool of 100 connections would silently queue an uncapped run.
    limit = 0 if any(c is None for c in caps) else sum(c for c in caps if c is not None)
    # Below the servers' 5 s idle close, so a kept-alive connection is never reused as it closes.
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, keepalive_timeout=2.5)
    async with aiohttp.ClientSession(connector=connector, headers=client.headers) as session:
        model = client.model or await discover_model(session, client.url)
        warm = await _warm_up(session, client, model, workloads, warmup)
        total = sum(len(w.requests) for w in workloads)
        # Bodies are encoded before the clock starts: JSON encoding of long prompts is the
        # client's work, and it must not land in the TTFT or the offered load.
        bodies = [[encode_body(client, model, req) for req in w.requests] for w in workloads]
        bar = Progress(total, enabled=progress)
        if start_gate is not None:
            await asyncio.to_thread(start_gate)
        started_at = time.time()
        t0 = time.perf_counter()
        per_workload = await asyncio.gather(
            *(
                _drive(session, client, w, b, t0, bar)
                for w, b in zip(workloads, bodies, strict=True)
            )
        )
        duration = time.perf_counter() - t0
    records = sorted((r for recs in per_workload for r in recs), key=lambda r: r.start)
    result = RunResult(records, duration, model, started_at, warmup_errors=warm)
    result.summary = summarize_run(records, duration, slo)
    return result


async def _warm_up(
    session: aiohttp.ClientSession,
    client: ClientConfig,
    model: str | None,
    workloads: Sequence[Workload],
    n: int,
) -> list[str]:
    """Send the first `n` requests of the workloads (shortened), unrecorded; their errors."""
    pool = [req for w in workloads for req in w.requests][:n]
    recs = await asyncio.gather(
        *(
            send(
                session,
                client,
                encode_body(client, model, BenchRequest(req.prompt, req.prompt_len, 4)),
                RequestRecord(0, "warmup", 0.0, req.prompt_len, 4),
                time.perf_counter(),
            )
            for req in pool
        )
    )
    errors = [f"{r.error_key}: {r.error_detail}" for r in recs if not r.ok]
    for e in errors:
        log.warning("warm-up request failed: %s", e)
    return errors


async def _drive(
    session: aiohttp.ClientSession,
    client: ClientConfig,
    w: Workload,
    bodies: list[bytes],
    t0: float,
    bar: Progress,
) -> list[RequestRecord]:
    offsets = schedule(len(w.requests), w.arrival, w.seed)
    cap = w.arrival.max_concurrency
    slots = asyncio.Semaphore(cap) if cap is not None else None

    async def one(index: int, req: BenchRequest) -> RequestRecord:
        body = bodies[index]
        rec = RequestRecord(index, w.name, 0.0, req.prompt_len, req.output_len)
        try:
            return await send(session, client, body, rec, t0)
        finally:
            if slots is not None:
                slots.release()
            bar.advance(failed=not rec.ok)

    tasks: list[asyncio.Task[RequestRecord]] = []
    for index, (req, offset) in enumerate(zip(w.requests, offsets, strict=True)):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is not None:
            await slots.acquire()
        tasks.append(asyncio.create_task(one(index, req)))
    return list(await asyncio.gather(*tasks))
