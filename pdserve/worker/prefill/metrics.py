"""What the prefill role adds to its engine's /metrics: the KV exports it owes decode workers.

* `pdserve_pd_exports_outstanding{decode}`: rooms not yet terminal (computing, writing,
  aborting or failing), per decode worker (its control identity). Only registered peers and
  peers with rooms are listed, so the label's values are bounded by the peers P holds.
* `pdserve_pd_exports_total{outcome}`: rooms ended, by what D was told: `done` (PrefillDone:
  every page written), `failed` (PrefillFailed), `aborted` (AbortAck for D's Abort), and
  `rejected` (a PrefillRequest refused with PrefillReject: no room opened).
* `pdserve_pd_export_bytes_total`: KV bytes reported to decode workers as complete.

Nothing is written on the engine thread for these: a custom collector reads the role's own
counters (`RoleStats`, plain ints) and its rooms at scrape time, on the scraping thread.
Reading an int or copying a dict's values is atomic under the GIL; a scrape may see a room
one tick late, never a torn value.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.worker.pd_role import RoleStats

OUTCOMES = ("done", "failed", "aborted", "rejected")  # RoleStats fields of the same names


class PrefillMetrics:
    """The prefill role's metrics, registered into its engine's registry."""

    def __init__(
        self,
        registry: CollectorRegistry,
        stats: RoleStats,
        room_peers: Callable[[], Iterable[str]],
        peer_ids: Callable[[], Iterable[str]],
    ) -> None:
        """`room_peers`: the decode peer of every room not yet terminal; `peer_ids`: the
        registered decode peers. Both are called on the scraping thread and must copy what
        they read in one step (`list(d)`), as the engine thread changes it meanwhile."""
        self._stats = stats
        self._room_peers = room_peers
        self._peer_ids = peer_ids
        registry.register(self)

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> list[Metric]:
        outstanding, exports, exported = self._families()
        per_peer = Counter(self._room_peers())
        for peer in set(self._peer_ids()) | set(per_peer):
            outstanding.add_metric([peer], per_peer[peer])
        for outcome in OUTCOMES:
            exports.add_metric([outcome], getattr(self._stats, outcome))
        exported.add_metric([], self._stats.bytes_acked)
        return [outstanding, exports, exported]

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, CounterMetricFamily, CounterMetricFamily]:
        return (
            GaugeMetricFamily(
                "pdserve_pd_exports_outstanding",
                "KV exports (rooms) not yet ended, per decode worker identity",
                labels=["decode"],
            ),
            CounterMetricFamily(
                "pdserve_pd_exports",
                "KV exports ended, by what the decode worker was told",
                labels=["outcome"],
            ),
            CounterMetricFamily(
                "pdserve_pd_export_bytes",
                "KV bytes reported to decode workers as written (PrefillDone)",
            ),
        )
