"""Prometheus metrics of one engine, in their own registry (several engines may share a process).

The inter-token latency is observed once per emitted token, hundreds of times a step at a large
batch: `StepHistogram` counts those into its buckets with one bisect each and publishes them once
a step (`flush`) through a custom collector, so `/metrics` shows the same series.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from pdserve.kvcache.prefix_cache import CacheStats
from pdserve.runtime.timing import LATENCY_BUCKETS


class EngineMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("pdserve_requests_running", "Requests holding KV pages", registry=r)
        self.waiting = Gauge(
            "pdserve_requests_waiting", "Requests queued for admission", registry=r
        )
        self.pages_used = Gauge("pdserve_kv_pages_used", "KV pages in use", registry=r)
        self.pages_total = Gauge("pdserve_kv_pages_total", "KV pages in the pool", registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generated_tokens = Counter("pdserve_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(
            "pdserve_requests_finished", "Finished requests by reason", ["reason"], registry=r
        )
        self.preemptions = Counter("pdserve_preemptions", "Requests preempted", registry=r)
        self.step_errors = Counter("pdserve_step_errors", "Engine steps that raised", registry=r)
        self.command_errors = Counter(
            "pdserve_command_errors", "Inbox commands whose handling raised", registry=r
        )
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = StepHistogram(
            "pdserve_inter_token_latency_seconds",
            "Time between a request's tokens",
            LATENCY_BUCKETS,
            r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Arrival to finish",
            buckets=LATENCY_BUCKETS + (120, 300),
            registry=r,
        )

        self.prefix_cache = PrefixCacheMetrics(r)

    def after_step(
        self, preempted: int, generated: int, counts: dict[str, int], cache: CacheStats | None
    ) -> None:
        """A step's counts, added once a step (each update of a metric takes a lock)."""
        self.preemptions.inc(preempted)
        if generated:
            self.generated_tokens.inc(generated)
        self.itl.flush()
        self.running.set(counts["running"])
        self.waiting.set(counts["waiting"])
        self.pages_used.set(counts["pages_used"])
        if cache is not None:
            self.prefix_cache.update(cache)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StepHistogram:
    """A Prometheus histogram observed many times a step: `observe` counts into local buckets
    (one bisect: an observation goes to the first bound >= it, as prometheus_client's does),
    `flush` publishes the running totals once a step as one tuple, and the registry collects
    it as an ordinary histogram (a custom collector: prometheus_client's public API, no lock
    per observation). Between flushes `/metrics` lags by at most one step.
    tests/engine/test_metrics.py checks the rendered text against a plain Histogram's."""

    def __init__(
        self, name: str, doc: str, buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        self.name, self.doc = name, doc
        self._bounds = [*buckets, math.inf]
        self._les = [floatToGoString(b) for b in self._bounds]
        self._counts = [0] * len(self._bounds)  # since the last flush, per bucket
        self._sum = 0.0
        self._published: tuple[tuple[int, ...], float] = (tuple(self._counts), 0.0)
        registry.register(self)

    def observe(self, amount: float) -> None:
        self._counts[bisect_left(self._bounds, amount)] += 1
        self._sum += amount

    def flush(self) -> None:
        if not any(self._counts):
            return
        totals, total_sum = self._published
        self._published = (
            tuple(t + n for t, n in zip(totals, self._counts, strict=True)),
            total_sum + self._sum,
        )
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.doc)]

    def collect(self) -> list[HistogramMetricFamily]:
        totals, total_sum = self._published  # one consistent snapshot, whatever thread reads
        family = HistogramMetricFamily(self.name, self.doc)
        cumulative = list(itertools.accumulate(totals))
        family.add_metric([], list(zip(self._les, cumulative, strict=True)), total_sum)
        return [family]


class PrefixCacheMetrics:
    """The prefix cache's counters, advanced to its stats (kvcache/prefix_cache.py) each step."""

    FIELDS = {  # CacheStats field -> (metric name, help)
        "queries": ("pdserve_prefix_cache_queries", "Prefix cache lookups"),
        "query_tokens": ("pdserve_prefix_cache_queries_tokens", "Tokens looked up in the cache"),
        "hits": ("pdserve_prefix_cache_hits", "Lookups that matched at least one page"),
        "hit_tokens": ("pdserve_prefix_cache_hit_tokens", "Prompt tokens served from the cache"),
        "inserted_pages": ("pdserve_prefix_cache_inserted_pages", "Pages added to the cache"),
        "evicted_pages": ("pdserve_prefix_cache_evicted_pages", "Pages evicted from the cache"),
        # The host tier (--host-cache-mb): zero without one.
        "host_hits": ("pdserve_prefix_cache_host_hits", "Lookups served pages from host memory"),
        "host_hit_tokens": (
            "pdserve_prefix_cache_host_hit_tokens",
            "Prompt tokens served from host memory (also in hit_tokens)",
        ),
        "host_written_pages": (
            "pdserve_prefix_cache_host_written_pages",
            "Evicted pages written to host memory",
        ),
        "host_evicted_pages": (
            "pdserve_prefix_cache_host_evicted_pages",
            "Pages evicted from host memory",
        ),
        "host_loaded_pages": (
            "pdserve_prefix_cache_host_loaded_pages",
            "Pages loaded from host memory into the KV pool",
        ),
        "host_load_failures": (
            "pdserve_prefix_cache_host_load_failures",
            "Host loads whose copy failed (the request recomputed)",
        ),
        "host_load_timeouts": (
            "pdserve_prefix_cache_host_load_timeouts",
            "Host loads past their deadline (the request recomputed)",
        ),
    }

    def __init__(self, registry: CollectorRegistry) -> None:
        self._counters = {
            f: Counter(name, doc, registry=registry) for f, (name, doc) in self.FIELDS.items()
        }
        self._seen = CacheStats()

    def update(self, stats: CacheStats) -> None:
        for f, counter in self._counters.items():
            delta = getattr(stats, f) - getattr(self._seen, f)
            if delta > 0:
                counter.inc(delta)
                setattr(self._seen, f, getattr(stats, f))
