"""What the chaos scenarios check after a fault, each a bounded poll over HTTP.

* deep health: the router's /health/deep (a real one-token request through every pair),
  polled until a predicate holds; the time from the fault to the first answer that passes
  is the figure the abort storm reports.
* a fresh completion: the cluster still serves a new request end to end.
* quiescence: every worker's /debug/invariants holds (no live request, no open room, every
  page free, every thread alive and fresh) and the router holds no request and no
  outstanding count: the storm left nothing behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.runtime import httpcall

POLL_S = 0.05
DEEP_CALL_S = 15.0  # one /health/deep: the router bounds each probe by 10 s
CALL_S = 5.0


@dataclass
class DeepResult:
    passed_after_s: float | None  # from `since` to the first passing answer; None: never
    calls: int
    last: Any  # the last answer's body (or error) for the report


def wait_deep_health(
    router: str,
    since: float,
    bound_s: float,
    passes: Callable[[dict[str, Any]], bool] | None = None,
) -> DeepResult:
    """Poll /health/deep until `passes(body)` (default: every pair ok), at most bound_s."""
    check = passes or (lambda body: bool(body.get("ok")))
    calls = 0
    last: Any = None
    while True:
        calls += 1
        r = httpcall.get(router + "/health/deep", DEEP_CALL_S)
        if isinstance(r.body, dict):
            last = r.body
            if check(r.body):
                return DeepResult(round(time.monotonic() - since, 3), calls, last)
        else:
            last = r.error or r.body
        if time.monotonic() - since > bound_s:
            return DeepResult(None, calls, last)
        time.sleep(POLL_S)


def pair_results(body: dict[str, Any]) -> dict[tuple[str | None, str], bool]:
    return {(p["prefill"], p["decode"]): bool(p["ok"]) for p in body.get("pairs", [])}


def dead_threads(worker: str) -> list[str]:
    """The names of a worker's threads that died or crashed (its /debug/state)."""
    body = httpcall.get(worker + "/debug/state", CALL_S).body
    threads = body.get("threads", []) if isinstance(body, dict) else []
    return [t["name"] for t in threads if not t["alive"] or t["crashes"]]


def fresh_completion(router: str, timeout_s: float = 20.0) -> str | None:
    """One new chat completion; None if it succeeded, else what went wrong."""
    body = {
        "messages": [{"role": "user", "content": "are you still there?"}],
        "max_tokens": 4,
        "temperature": 0,
        "timeout": timeout_s,
    }
    r = httpcall.post(router + "/v1/chat/completions", body, timeout_s + 10.0)
    if not r.ok:
        return f"HTTP {r.status}: {r.error or str(r.body)[:300]}"
    finish = r.body["choices"][0]["finish_reason"]
    return None if finish in ("stop", "length") else f"finish_reason {finish!r}"


@dataclass
class Quiet:
    ok: bool
    after_s: float
    workers: dict[str, Any] = field(default_factory=dict)  # url -> last /debug/invariants
    router: dict[str, Any] = field(default_factory=dict)  # live requests, outstanding
    violations: list[str] = field(default_factory=list)

    @property
    def leaked_pages(self) -> int:
        """Pages still in use once the bound passed (zero when quiet); the prefix cache's are
        evictable, not leaked."""
        return self._pools(lambda p: p["pages_total"] - p["pages_free"] - p.get("pages_cached", 0))

    @property
    def leaked_state_slots(self) -> int:
        """Per-request state slots still taken once the bound passed (zero when quiet)."""
        return self._pools(lambda p: p.get("state_slots", 0) - p.get("state_slots_free", 0))

    def _pools(self, count: Callable[[dict[str, Any]], int]) -> int:
        """`count` summed over the workers' pools, when not quiet."""
        if self.ok:
            return 0
        pools = [inv.get("pool") for inv in self.workers.values() if isinstance(inv, dict)]
        return sum(count(pool) for pool in pools if pool)


def router_leftovers(router: str) -> tuple[dict[str, Any], list[str]]:
    r = httpcall.get(router + "/debug/cluster", 10.0)
    if not isinstance(r.body, dict):
        return {}, [f"router /debug/cluster: {r.error or r.status}"]
    rt = r.body["router"]
    seen = {
        "live_requests": rt["live_requests"],
        "outstanding": {w["url"]: w["outstanding"] for w in rt["workers"]},
    }
    bad = [f"router still holds {rt['live_requests']} live requests"] if rt["live_requests"] else []
    bad += [f"router counts {n} outstanding on {u}" for u, n in seen["outstanding"].items() if n]
    return seen, bad


def wait_quiet(router: str, workers: list[str], bound_s: float) -> Quiet:
    """Poll until every worker's invariants and the router's counters are clean."""
    t0 = time.monotonic()
    while True:
        q = Quiet(False, 0.0)
        for url in workers:
            r = httpcall.get(url + "/debug/invariants", CALL_S)
            q.workers[url] = r.body if isinstance(r.body, dict) else {"error": r.error}
            if not isinstance(r.body, dict):
                q.violations.append(f"{url}: /debug/invariants: {r.error or r.status}")
            elif not r.body.get("ok"):
                q.violations += [f"{url}: {v}" for v in r.body.get("violations", [])]
        q.router, bad = router_leftovers(router)
        q.violations += bad
        q.after_s = round(time.monotonic() - t0, 3)
        q.ok = not q.violations
        if q.ok or q.after_s > bound_s:
            return q
        time.sleep(POLL_S * 2)
