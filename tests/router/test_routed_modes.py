"""Whether PD happens, seen from the router: each request counted once by how it is served.

`pdserve_router_routed_requests_total{mode}` and /debug/cluster's `routed` come from one
count (`Registry.count_routed`). By design `choose` never routes decode-only: a decode
worker of a PD fleet is in rotation only with a healthy prefill partner, so with no healthy
prefill worker a request is refused (NoRoute), not served without one.
"""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from pdserve.router.policy import Policy, make_policy
from pdserve.router.registry import NoRoute, Registry, Route, RouteMode
from tests.router.test_backend import (
    FakeWorker,
    closed_port_url,
    collect,
    line,
    make_backend,
    run,
    stream,
)

D_INFO = {"role": "decode"}


def rr() -> Policy:
    return make_policy("round-robin")


def pd_fleet() -> Registry:
    return Registry.build(
        [("http://d0", D_INFO)],
        [("http://p0", {"control": "tcp://p0:1"}), ("http://p1", {"control": "tcp://p1:1"})],
        rr(),
    )


def test_routes_count_by_mode_and_decode_only_says_when():
    reg = pd_fleet()
    pd = reg.choose()
    assert reg.count_routed(pd, 10.0) is RouteMode.PD
    # A route without P in a fleet that has P workers: decode-only (never chosen: see below).
    assert reg.count_routed(Route(reg.decode[0], None), 12.0) is RouteMode.DECODE_ONLY
    assert reg.routed_modes == {RouteMode.PD: 1, RouteMode.DECODE_ONLY: 1, RouteMode.COLOCATED: 0}
    assert reg.last_decode_only == 12.0
    snap = reg.snapshot()
    assert snap["routed_modes"] == {"pd": 1, "decode_only": 1, "colocated": 0}
    assert snap["last_decode_only_age_s"] is not None

    colocated = Registry.build([("http://c0", {"role": "colocated"})], [], rr())
    assert colocated.count_routed(colocated.choose(), 1.0) is RouteMode.COLOCATED
    assert colocated.snapshot()["last_decode_only_age_s"] is None
    # A decode worker with no prefill pool (check_fleet refuses such a fleet) would prefill
    # locally: decode-only, not co-located.
    lone = Registry.build([("http://d0", D_INFO)], [], rr())
    assert lone.count_routed(lone.choose(), 1.0) is RouteMode.DECODE_ONLY


def test_with_no_healthy_prefill_worker_a_request_is_refused_not_served_decode_only():
    reg = pd_fleet()
    reg.mark_worker("http://p0", False, "GET /health: cannot connect", 1.0)
    assert reg.choose().prefill is reg.prefill[1]  # the healthy one, every time
    assert reg.choose().prefill is reg.prefill[1]
    reg.mark_worker("http://p1", False, "GET /health: cannot connect", 1.0)
    with pytest.raises(NoRoute, match="no healthy prefill"):
        reg.choose()


def routed(b, mode: str) -> float | None:
    return b.metrics.registry.get_sample_value(
        "pdserve_router_routed_requests_total", {"mode": mode}
    )


def test_the_backend_counts_each_request_once_by_its_first_route():
    async def body() -> None:
        async def script(req: web.Request) -> web.StreamResponse:
            return await stream(req, line([1], "stop"))

        async with FakeWorker(script) as w, aiohttp.ClientSession() as s:
            b = make_backend(s, [w.url], prefill=["http://p0"])
            for mode in ("pd", "decode_only", "colocated"):
                assert routed(b, mode) == 0  # exported at zero: a rate() has a baseline
            await collect(b)
            await collect(b)
            assert (routed(b, "pd"), routed(b, "decode_only")) == (2, 0)
            # A re-route after a refused connection is the same request: counted once.
            b2 = make_backend(s, [closed_port_url(), w.url])
            await collect(b2)
            assert routed(b2, "colocated") == 1
            assert b2.metrics.registry.get_sample_value("pdserve_router_connect_retries_total")
            # With no route at all, nothing is counted as routed (it is "rejected").
            b3 = make_backend(s, [w.url], prefill=["http://p0"])
            b3.registry.mark_worker("http://p0", False, "down", 1.0)
            last = (await collect(b3))[-1]
            assert last.finish_reason == "error" and "no healthy prefill" in (last.error or "")
            assert routed(b3, "pd") == routed(b3, "decode_only") == 0

    run(body())
