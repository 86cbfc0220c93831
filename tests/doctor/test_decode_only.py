"""Doctor on requests served decode-only in a cluster that has prefill workers.

Two counts show it: the router's (`routed_modes.decode_only`, with the age of the last one) and
each decode worker's (`prefill.local` in its role's /debug/state). Recent is degraded,
older a note; a co-located cluster has nothing to say about it.
"""

from __future__ import annotations

from typing import Any

from pdserve.doctor.diagnosis import RECENT_S, Severity, diagnose
from tests.doctor.clusterdocs import D_URL, P_URL, cluster, row, state

NOW = 1_800_000_000.0


def with_prefill_counts(s: dict[str, Any], remote: int, local: int, age: float | None):
    s["engine"]["role"]["prefill"] = {"remote": remote, "local": local, "last_local_age_s": age}
    return s


def findings(doc: dict[str, Any]) -> list[tuple[Severity, str, str]]:
    return [(f.severity, f.where, f.what) for f in diagnose(doc, NOW).findings]


def test_a_pd_cluster_serving_through_p_has_no_such_finding():
    doc = cluster(d=with_prefill_counts(state("decode"), remote=40, local=0, age=None))
    doc["router"]["routed_modes"] = {"pd": 40, "decode_only": 0, "colocated": 0}
    assert diagnose(doc, NOW).code == 0 and findings(doc) == []


def test_recent_local_prefills_on_d_are_degraded_and_say_how_many():
    doc = cluster(d=with_prefill_counts(state("decode"), remote=7, local=3, age=4.0))
    doc["router"]["routed_modes"] = {"pd": 7, "decode_only": 0, "colocated": 0}
    result = diagnose(doc, NOW)
    assert result.code == 1
    [(severity, where, what)] = findings(doc)
    assert severity == Severity.DEGRADED and where == f"decode worker {D_URL} (pid 12)"
    assert what.startswith("3 of 10 requests were prefilled here, decode-only")
    assert "calls it directly" in what and what.endswith("(the last 4s ago)")
    assert "VERDICT: degraded" in result.verdict()


def test_old_local_prefills_are_a_note():
    doc = cluster(d=with_prefill_counts(state("decode"), 7, 3, RECENT_S + 5))
    [(severity, _, what)] = findings(doc)
    assert severity == Severity.NOTE and diagnose(doc, NOW).code == 0
    assert what.endswith(f"(the last {RECENT_S + 5:.0f}s ago)")


def test_router_decode_only_names_the_unhealthy_prefill_worker_and_refusals():
    rows = [
        row(P_URL, "prefill", 11, healthy=False, in_rotation=False, last_error="GET /health: 503"),
        row(D_URL, "decode", 12),
    ]
    p = state("prefill")
    p["engine"]["role"]["stats"] = {"rejected": 5}
    doc = cluster(p=p, rows=rows)
    doc["router"]["routed_modes"] = {"pd": 90, "decode_only": 10, "colocated": 0}
    doc["router"]["last_decode_only_age_s"] = 2.5
    router = [f for f in findings(doc) if f[1] == "router"]
    assert len(router) == 1 and router[0][0] == Severity.DEGRADED
    what = router[0][2]
    assert what.startswith("10 of 100 requests routed since it started went to a decode worker")
    assert f"prefill worker {P_URL} unhealthy: GET /health: 503" in what
    assert f"prefill worker {P_URL} refused 5 PrefillRequests" in what


def test_a_colocated_fleet_never_reports_decode_only():
    rows = [row(D_URL, "colocated", 12)]
    doc = cluster(rows=rows, pairs=[{"prefill": None, "decode": D_URL, "ok": True, "usable": True}])
    doc["workers"] = {D_URL: {"role": "colocated", "state": state("colocated")}}
    doc["router"]["routed_modes"] = {"pd": 0, "decode_only": 0, "colocated": 12}
    assert findings(doc) == []


def test_a_decode_worker_read_alone_reports_its_local_prefills():
    s = with_prefill_counts(state("decode"), remote=1, local=2, age=1.0)
    doc = {"server": {"url": "http://127.0.0.1:1004", "info": {"role": "decode"}}, "state": s}
    result = diagnose(doc, NOW)
    degraded = [f for f in result.findings if f.severity == Severity.DEGRADED]
    assert result.code == 1 and len(degraded) == 1
    assert degraded[0].what.startswith("2 of 3 requests were prefilled here, decode-only")
