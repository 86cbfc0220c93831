"""Selection policies and the worker registry: pure, exact, milliseconds."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdserve.router.policy import LeastOutstanding, RoundRobin, make_policy
from pdserve.router.registry import NoRoute, Registry


@dataclass
class W:
    index: int
    outstanding: int = 0


def picks(policy, pool: list[W], n: int) -> list[int]:
    return [policy.choose("decode", pool).index for _ in range(n)]


def test_round_robin_cycles_and_skips_missing_workers():
    rr = RoundRobin()
    ws = [W(0), W(1), W(2)]
    assert picks(rr, ws, 7) == [0, 1, 2, 0, 1, 2, 0]
    # Worker 1 out of rotation: the turn passes to the next one present, order kept.
    assert picks(rr, [ws[0], ws[2]], 4) == [2, 0, 2, 0]
    assert picks(rr, ws, 3) == [1, 2, 0]


def test_round_robin_ignores_load():
    rr = RoundRobin()
    assert picks(rr, [W(0, 9), W(1, 0)], 4) == [0, 1, 0, 1]


def test_least_outstanding_prefers_idle_and_rotates_ties():
    lo = LeastOutstanding()
    assert picks(lo, [W(0, 3), W(1, 1), W(2, 2)], 3) == [1, 1, 1]
    # Sequential traffic: everybody idle at pick time; ties must not pin worker 0.
    assert picks(lo, [W(0), W(1), W(2)], 6) == [2, 0, 1, 2, 0, 1]
    assert picks(lo, [W(0, 1), W(1, 0), W(2, 0)], 4) == [2, 1, 2, 1]  # after 1 comes 2


def test_pools_rotate_independently_and_empty_is_refused():
    rr = RoundRobin()
    assert rr.choose("decode", [W(0), W(1)]).index == 0
    assert rr.choose("prefill", [W(0), W(1)]).index == 0
    assert rr.choose("decode", [W(0), W(1)]).index == 1
    with pytest.raises(ValueError, match="no decode candidates"):
        rr.choose("decode", [])
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random")


def colocated(n: int, policy: str = "round-robin") -> Registry:
    return Registry.build([(f"http://d{i}", {}) for i in range(n)], [], make_policy(policy))


def pd(n_p: int, n_d: int) -> Registry:
    return Registry.build(
        [(f"http://d{i}", {}) for i in range(n_d)],
        [(f"http://p{i}", {"control": f"tcp://p{i}:1"}) for i in range(n_p)],
        make_policy("round-robin"),
    )


def test_colocated_routes_have_no_prefill_and_count_outstanding():
    reg = colocated(2, "least-outstanding")
    a = reg.choose()
    reg.acquire(a)
    b = reg.choose()
    reg.acquire(b)
    assert a.prefill is None and {a.decode.url, b.decode.url} == {"http://d0", "http://d1"}
    assert a.key == (None, a.decode.url)
    reg.release(a)
    assert reg.choose().decode is a.decode  # the idle one
    reg.release(b)
    with pytest.raises(RuntimeError, match="release without acquire"):
        reg.release(b)
    assert [w.routed for w in reg.decode] == [1, 1]


def test_unhealthy_worker_leaves_and_rejoins_rotation():
    reg = colocated(2)
    note = reg.mark_worker("http://d1", False, "connection refused", now=1.0)
    assert note and "left rotation" in note and "connection refused" in note
    assert reg.mark_worker("http://d1", False, "still refused", now=2.0) is None
    assert {reg.choose().decode.url for _ in range(4)} == {"http://d0"}
    assert "back in rotation" in (reg.mark_worker("http://d1", True, None, now=3.0) or "")
    assert {reg.choose().decode.url for _ in range(4)} == {"http://d0", "http://d1"}


def test_failed_pair_stays_out_until_a_deep_check_passes():
    reg = colocated(2)
    note = reg.mark_pair((None, "http://d0"), False, 0.5, "timed out", now=10.0)
    assert note and "out of rotation" in note
    assert {reg.choose().decode.url for _ in range(4)} == {"http://d1"}
    # Liveness passing does not bring a pair back; only a deep pass does.
    reg.mark_worker("http://d0", True, None, now=11.0)
    assert {reg.choose().decode.url for _ in range(4)} == {"http://d1"}
    assert reg.pairs_to_retry(now=12.0, retry_s=5.0) == []  # probed 2 s ago
    assert reg.pairs_to_retry(now=16.0, retry_s=5.0) == [(None, "http://d0")]
    reg.mark_worker("http://d0", False, "down", now=16.0)
    assert reg.pairs_to_retry(now=16.0, retry_s=5.0) == []  # no point probing a dead worker
    reg.mark_worker("http://d0", True, None, now=17.0)
    assert "back in rotation" in (reg.mark_pair((None, "http://d0"), True, 0.1, None, 17.0) or "")
    assert {reg.choose().decode.url for _ in range(4)} == {"http://d0", "http://d1"}


def test_nothing_in_rotation_says_why_for_each_worker():
    reg = colocated(2)
    reg.mark_worker("http://d0", False, "HTTP 503: engine loop stalled", now=1.0)
    reg.mark_pair((None, "http://d1"), False, 1.0, "worker http://d1: generated 0 tokens", 1.0)
    with pytest.raises(NoRoute) as e:
        reg.choose()
    msg = str(e.value)
    assert "http://d0: unhealthy (HTTP 503: engine loop stalled)" in msg
    assert "http://d1: no usable pair (worker http://d1: generated 0 tokens)" in msg
    with pytest.raises(NoRoute, match="failed this request already"):
        colocated(1).choose(exclude=["http://d0"])


def test_pd_routes_pick_both_roles_and_respect_pair_health():
    reg = pd(2, 2)
    assert len(reg.pair_keys()) == 4
    routes = [reg.choose() for _ in range(4)]
    assert {r.key for r in routes} == {("http://p0", "http://d0"), ("http://p1", "http://d1")}
    assert routes[0].prefill is not None and routes[0].prefill.control == "tcp://p0:1"
    # Pair (p0, d0) broken: d0 still takes traffic, through p1 only.
    reg.mark_pair(("http://p0", "http://d0"), False, 1.0, "transfer failed", now=1.0)
    for _ in range(6):
        r = reg.choose()
        assert r.key != ("http://p0", "http://d0")
    # Every P down: no D can serve, and the registry says so.
    reg.mark_worker("http://p0", False, "gone", 2.0)
    reg.mark_worker("http://p1", False, "gone", 2.0)
    assert not any(reg.in_rotation(w) for w in reg.workers)
    with pytest.raises(NoRoute, match="no healthy prefill"):
        reg.choose()


def test_snapshot_lists_workers_and_pairs():
    reg = pd(1, 2)
    reg.mark_pair(("http://p0", "http://d1"), False, 0.25, "boom", now=1.0)
    snap = reg.snapshot()
    assert snap["policy"] == "round-robin"
    assert [(w["url"], w["role"], w["in_rotation"]) for w in snap["workers"]] == [
        ("http://p0", "prefill", True),
        ("http://d0", "decode", True),
        ("http://d1", "decode", False),
    ]
    bad = [p for p in snap["pairs"] if p["ok"] is False]
    assert bad == [
        {
            "prefill": "http://p0",
            "decode": "http://d1",
            "ok": False,
            "usable": False,
            "latency_ms": 250.0,
            "error": "boom",
            "passes": 0,
            "failures": 1,
            "age_s": bad[0]["age_s"],
        }
    ]
