"""What the decode role adds to its engine's /metrics: whether PD happens, and what it costs.

* `pdserve_pd_requests_total{prefill}`: requests this decode worker took, by where their
  prompt is computed: `remote` (a /generate naming a prefill worker: a room) or `local` (no
  prefill address: the engine prefills it here, decode-only). A local count on a decode
  worker of a PD cluster is the silent degradation operators ask about.
* per request whose KV a prefill worker delivered, counted as it starts decoding:
  `pdserve_pd_kv_bytes` (the bytes PrefillDone reported), `pdserve_pd_kv_transfer_seconds`
  (from the PrefillRequest that P accepted leaving D to the KV being complete: PrefillDone
  and, on tcp and nixl, every byte landed) and `pdserve_pd_kv_wait_seconds` (from the room's
  opening, once its pages were leased, to the same moment: pairing included).
* `pdserve_pd_first_tokens_ahead_total`: first tokens a prefill worker sampled that this
  decode worker streamed before their KV had landed (protocol FirstToken); the others went out
  as their request started decoding (`pdserve_pd_kv_wait_seconds_count` counts those that did).

Only the engine thread writes here, once per request: the counts are plain ints that a
custom collector reads at scrape time, and the histograms are `StepHistogram`s published
after each observation, so nothing takes a lock on the engine thread (engine/metrics.py
says why that matters).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from pdserve.engine.metrics import StepHistogram
from pdserve.runtime.timing import LATENCY_BUCKETS
from pdserve.worker.decode.rooms import DRoom

# KV bytes per request: 1 KiB to 16 GiB, by fours (a tiny model's prompt to a long one's).
KV_BYTES_BUCKETS = tuple(float(4**k) for k in range(5, 18))
REQUESTS = "pdserve_pd_requests"
AHEAD = "pdserve_pd_first_tokens_ahead"


class DecodeMetrics:
    """The decode role's metrics, registered into its engine's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.remote = 0  # requests with a prefill address (a room each)
        self.local = 0  # requests without one: prefilled by this engine
        self.last_local: float | None = None  # monotonic: when the last local one came
        self.first_tokens_ahead = 0  # first tokens streamed before their KV landed
        self.kv_bytes = StepHistogram(
            "pdserve_pd_kv_bytes",
            "KV bytes a prefill worker delivered per request",
            KV_BYTES_BUCKETS,
            registry,
        )
        self.kv_transfer = StepHistogram(
            "pdserve_pd_kv_transfer_seconds",
            "PrefillRequest sent to KV complete (PrefillDone and every byte landed)",
            LATENCY_BUCKETS,
            registry,
        )
        self.kv_wait = StepHistogram(
            "pdserve_pd_kv_wait_seconds",
            "Room opened (pages leased) to decoding start: how long a request waited for KV",
            LATENCY_BUCKETS,
            registry,
        )
        registry.register(self)

    def prefill_remote(self) -> None:
        self.remote += 1

    def prefill_local(self, now: float) -> None:
        self.local += 1
        self.last_local = now

    def kv_complete(self, room: DRoom, now: float) -> None:
        """`room`'s KV is complete (its PrefillDone checked) and its request starts decoding
        at `now`."""
        sent = room.opened if room.requested is None else room.requested
        for hist, value in (
            (self.kv_bytes, float(room.done.kv_bytes if room.done is not None else 0)),
            (self.kv_transfer, now - sent),
            (self.kv_wait, now - room.opened),
        ):
            hist.observe(value)
            hist.flush()

    def snapshot(self, now: float) -> dict[str, Any]:
        """For /debug/state (doctor reads it: keep the keys)."""
        last = self.last_local
        return {
            "remote": self.remote,
            "local": self.local,
            "last_local_age_s": None if last is None else round(now - last, 3),
            "first_tokens_ahead": self.first_tokens_ahead,
        }

    # -- the registry's collector protocol ---------------------------------------------------
    def describe(self) -> list[CounterMetricFamily]:
        return [self._requests(), self._ahead()]

    def collect(self) -> list[CounterMetricFamily]:
        family = self._requests()
        family.add_metric(["remote"], self.remote)
        family.add_metric(["local"], self.local)
        ahead = self._ahead()
        ahead.add_metric([], self.first_tokens_ahead)
        return [family, ahead]

    @staticmethod
    def _requests() -> CounterMetricFamily:
        doc = "Requests this decode worker took, by where their prompt is computed"
        return CounterMetricFamily(REQUESTS, doc, labels=["prefill"])

    @staticmethod
    def _ahead() -> CounterMetricFamily:
        doc = "First tokens from a prefill worker streamed before their KV landed"
        return CounterMetricFamily(AHEAD, doc)
