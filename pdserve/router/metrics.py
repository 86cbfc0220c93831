"""The router's Prometheus metrics, in their own registry.

Per-worker gauges are refreshed from the registry at scrape time, so they can never drift
from what the router actually routes by. The prefill label of a co-located pair is "".

A router of several processes (router/pool.py) sets PROMETHEUS_MULTIPROC_DIR for each before
it imports prometheus_client: every process then keeps its series in files there, and a
scrape of any of them answers for all. Counters and histograms add up; per-worker gauges are
each process's view, refreshed every health round as well (a scrape reaches one process):
requests in flight add up over the live processes, health and rotation are the least of
them (a worker one process cannot reach reads 0), a deep probe's latency the largest.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from pdserve.router.registry import PairKey, Registry, RouteMode
from pdserve.runtime.timing import LATENCY_BUCKETS

OUTCOMES = ("ok", "error", "aborted", "rejected")  # finished | failed | client left | no worker
SHARED_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own name for it


class RouterMetrics:
    def __init__(self) -> None:
        # Where every process of a multi-process router keeps its series; None: this one only.
        self.shared_dir = os.environ.get(SHARED_DIR_ENV) or None
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_router_requests", "Routed requests by outcome", ["outcome"], registry=r
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # export zeros, so a rate() has a baseline
        # Whether PD happens: a request counts once, by how its first route serves it.
        self.routed = Counter(
            "pdserve_router_routed_requests",
            "Routed requests by how they are served: pd (a prefill worker computes the "
            "prompt), decode_only (a decode worker prefills it itself), colocated",
            ["mode"],
            registry=r,
        )
        for mode in RouteMode:
            self.routed.labels(mode.value)
        self.connect_retries = Counter(
            "pdserve_router_connect_retries",
            "Requests re-routed because a worker refused the connection",
            registry=r,
        )
        self.ttft = Histogram(
            "pdserve_router_time_to_first_token_seconds",
            "Routing to the first token, seen from the router",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.outstanding = Gauge(
            "pdserve_router_worker_outstanding",
            "Requests routed to a worker and not finished",
            ["worker", "role"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.healthy = Gauge(
            "pdserve_router_worker_healthy",
            "1 if the last liveness check passed",
            ["worker", "role"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.in_rotation = Gauge(
            "pdserve_router_worker_in_rotation",
            "1 if the worker takes new requests",
            ["worker", "role"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.deep_checks = Counter(
            "pdserve_router_deep_health_checks",
            "Deep health probes by pair and result",
            ["prefill", "decode", "result"],
            registry=r,
        )
        self.deep_ok = Gauge(
            "pdserve_router_deep_health_ok",
            "1 if the pair's last deep probe passed",
            ["prefill", "decode"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.deep_latency = Gauge(
            "pdserve_router_deep_health_latency_seconds",
            "Latency of the pair's last deep probe",
            ["prefill", "decode"],
            registry=r,
            multiprocess_mode="livemax",
        )

    def deep_result(self, key: PairKey, ok: bool, latency_s: float) -> None:
        labels = (key[0] or "", key[1])
        self.deep_checks.labels(*labels, "pass" if ok else "fail").inc()
        self.deep_ok.labels(*labels).set(1 if ok else 0)
        self.deep_latency.labels(*labels).set(latency_s)

    def publish(self, workers: Registry) -> None:
        """Set the per-worker gauges from the registry (at each scrape and health round)."""
        for w in workers.workers:
            labels = (w.url, w.role.value)
            self.outstanding.labels(*labels).set(w.outstanding)
            self.healthy.labels(*labels).set(1 if w.healthy else 0)
            self.in_rotation.labels(*labels).set(1 if workers.in_rotation(w) else 0)

    def render(self, workers: Registry) -> bytes:
        self.publish(workers)
        if self.shared_dir is None:
            return generate_latest(self.registry)
        every = CollectorRegistry()  # every process's files, this one's included
        MultiProcessCollector(every, self.shared_dir)
        return generate_latest(every)
