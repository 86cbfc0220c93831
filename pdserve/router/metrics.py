"""The router's Prometheus metrics, in their own registry.

Per-worker gauges are refreshed from the registry at scrape time, so they can never drift
from what the router actually routes by. The prefill label of a co-located pair is "".
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.router.registry import PairKey, Registry
from pdserve.runtime.timing import LATENCY_BUCKETS

OUTCOMES = ("ok", "error", "aborted", "rejected")  # finished | failed | client left | no worker


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_router_requests", "Routed requests by outcome", ["outcome"], registry=r
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # export zeros, so a rate() has a baseline
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
        )
        self.healthy = Gauge(
            "pdserve_router_worker_healthy",
            "1 if the last liveness check passed",
            ["worker", "role"],
            registry=r,
        )
        self.in_rotation = Gauge(
            "pdserve_router_worker_in_rotation",
            "1 if the worker takes new requests",
            ["worker", "role"],
            registry=r,
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
        )
        self.deep_latency = Gauge(
            "pdserve_router_deep_health_latency_seconds",
            "Latency of the pair's last deep probe",
            ["prefill", "decode"],
            registry=r,
        )

    def deep_result(self, key: PairKey, ok: bool, latency_s: float) -> None:
        labels = (key[0] or "", key[1])
        self.deep_checks.labels(*labels, "pass" if ok else "fail").inc()
        self.deep_ok.labels(*labels).set(1 if ok else 0)
        self.deep_latency.labels(*labels).set(latency_s)

    def render(self, workers: Registry) -> bytes:
        for w in workers.workers:
            labels = (w.url, w.role.value)
            self.outstanding.labels(*labels).set(w.outstanding)
            self.healthy.labels(*labels).set(1 if w.healthy else 0)
            self.in_rotation.labels(*labels).set(1 if workers.in_rotation(w) else 0)
        return generate_latest(self.registry)
