"""The worker registry: who is out there, who is healthy, who gets the next request.

Sans-I/O: the health loop and the backend report what they saw (`mark_worker`, `mark_pair`)
and ask for a route (`choose`); nothing here awaits, so the policy and the rotation rules are
unit-tested in milliseconds.

Rotation rules (the only place they live):
* a worker is healthy until a liveness check fails, and healthy again once one passes;
* a pair (P, D) — (None, D) when D is a co-located worker — is usable unless its last deep
  check failed; a failed pair stays out until a deep check passes again;
* D takes traffic iff it is healthy and has a usable pair with a healthy P (or its own
  (None, D) pair is usable when there are no prefill workers).
`outstanding` is incremented by `acquire` and decremented exactly once by `release`.

Each request is counted once by how its first route serves it (`count_routed`, a
`RouteMode`): `choose` gives a decode worker a prefill partner whenever the fleet has a
prefill pool, so DECODE_ONLY is never chosen; it is counted all the same, so that a change
to that rule shows on /metrics rather than silently serving without P.

The prompt goes to the policy only for the pool that keeps the prefix cache: co-located
workers, or prefill workers in PD (D is then chosen by the policy without it, i.e. by load).
A worker that leaves rotation is forgotten by the policy: when it comes back, its cache may be
empty (a restart) and whatever the policy guessed of it is stale.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.router.policy import Policy

PairKey = tuple[str | None, str]  # (prefill URL, or None for a co-located D; decode URL)


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"  # a decode worker, or a co-located one when there is no prefill pool


class RouteMode(enum.Enum):
    """How a routed request is served (the router's pdserve_router_routed_requests{mode})."""

    PD = "pd"  # a prefill worker computes its prompt, a decode worker decodes it
    DECODE_ONLY = "decode_only"  # a decode worker prefills it itself: no P was chosen
    COLOCATED = "colocated"  # a co-located worker: the fleet has no prefill pool


@dataclass
class Worker:
    index: int  # position within its role's pool; the policies rotate over it
    url: str
    role: Role
    info: dict[str, Any]  # its GET /info, read once at startup
    outstanding: int = 0
    routed: int = 0
    healthy: bool = True
    last_error: str | None = None
    last_check: float | None = None  # monotonic time of the last liveness check

    @property
    def control(self) -> str | None:
        """A prefill worker's control address, which decode workers connect to."""
        value = self.info.get("control")
        return value if isinstance(value, str) else None

    def snapshot(self, now: float, in_rotation: bool) -> dict[str, Any]:
        return {
            "url": self.url,
            "role": self.role.value,
            "worker_role": self.info.get("role"),
            "pid": self.info.get("pid"),
            "healthy": self.healthy,
            "in_rotation": in_rotation,
            "outstanding": self.outstanding,
            "routed": self.routed,
            "last_error": self.last_error,
            "last_check_age_s": None
            if self.last_check is None
            else round(now - self.last_check, 3),
            "info": self.info,
        }


@dataclass
class PairHealth:
    ok: bool | None = None  # None: never probed, usable until a probe fails
    latency_s: float | None = None
    error: str | None = None
    checked_at: float | None = None
    passes: int = 0
    failures: int = 0
    served_at: float | None = None  # when a client request through the pair last succeeded


@dataclass(frozen=True)
class Route:
    decode: Worker
    prefill: Worker | None

    @property
    def key(self) -> PairKey:
        return (self.prefill.url if self.prefill else None, self.decode.url)

    def describe(self) -> str:
        d = f"decode worker {self.decode.url}"
        return d if self.prefill is None else f"{d} (prefill worker {self.prefill.url})"


class NoRoute(RuntimeError):
    """No worker can take a request: the fleet's fault, not the client's."""


@dataclass
class Registry:
    decode: list[Worker]
    prefill: list[Worker]
    policy: Policy
    pairs: dict[PairKey, PairHealth] = field(default_factory=dict)
    changes: int = 0  # rotation changes so far: a cached deep-health answer older is stale
    routed_modes: dict[RouteMode, int] = field(default_factory=lambda: dict.fromkeys(RouteMode, 0))
    last_decode_only: float | None = None  # monotonic: when a request was last routed so

    @classmethod
    def build(
        cls,
        decode: Sequence[tuple[str, dict[str, Any]]],
        prefill: Sequence[tuple[str, dict[str, Any]]],
        policy: Policy,
    ) -> Registry:
        reg = cls(
            [Worker(i, url, Role.DECODE, info) for i, (url, info) in enumerate(decode)],
            [Worker(i, url, Role.PREFILL, info) for i, (url, info) in enumerate(prefill)],
            policy,
        )
        reg.pairs = {key: PairHealth() for key in reg.pair_keys()}
        return reg

    # -- queries ------------------------------------------------------------------------
    @property
    def workers(self) -> list[Worker]:
        return self.prefill + self.decode

    def worker(self, url: str) -> Worker:
        for w in self.workers:
            if w.url == url:
                return w
        raise KeyError(f"no worker {url!r} in the registry")

    def pair_keys(self) -> list[PairKey]:
        if not self.prefill:
            return [(None, d.url) for d in self.decode]
        return [(p.url, d.url) for p in self.prefill for d in self.decode]

    def pair_usable(self, key: PairKey) -> bool:
        p_url, d_url = key
        if not self.worker(d_url).healthy or self.pairs[key].ok is False:
            return False
        return p_url is None or self.worker(p_url).healthy

    def partners(self, d: Worker) -> list[Worker]:
        """Healthy prefill workers whose pair with `d` is usable."""
        return [p for p in self.prefill if self.pair_usable((p.url, d.url))]

    def in_rotation(self, w: Worker) -> bool:
        if w.role is Role.PREFILL:
            return any(self.pair_usable((w.url, d.url)) for d in self.decode)
        if not self.prefill:
            return self.pair_usable((None, w.url))
        return bool(self.partners(w))

    # -- routing ------------------------------------------------------------------------
    def choose(self, exclude: Iterable[str] = (), prompt: Sequence[int] = ()) -> Route:
        """A route for the next request (its prompt token ids, for a cache-aware policy);
        raises NoRoute saying why every worker is out."""
        skip = set(exclude)
        ds = [d for d in self.decode if d.url not in skip and self.in_rotation(d)]
        if not ds:
            raise NoRoute(self._why_none(skip))
        if not self.prefill:
            return Route(self.policy.choose(Role.DECODE.value, ds, prompt), None)
        d = self.policy.choose(Role.DECODE.value, ds)
        return Route(d, self.policy.choose(Role.PREFILL.value, self.partners(d), prompt))

    def count_routed(self, route: Route, now: float) -> RouteMode:
        """Count a request by how `route`, its first, serves it (`now`: monotonic). A route
        without P is DECODE_ONLY when the fleet has prefill workers or D is a decode worker
        (which then prefills locally), else COLOCATED."""
        if route.prefill is not None:
            mode = RouteMode.PD
        elif self.prefill or route.decode.info.get("role") == "decode":
            mode = RouteMode.DECODE_ONLY
            self.last_decode_only = now
        else:
            mode = RouteMode.COLOCATED
        self.routed_modes[mode] += 1
        return mode

    def acquire(self, route: Route) -> None:
        for w in (route.decode, route.prefill):
            if w is not None:
                w.outstanding += 1
                w.routed += 1

    def release(self, route: Route) -> None:
        for w in (route.decode, route.prefill):
            if w is not None:
                if w.outstanding <= 0:
                    raise RuntimeError(f"release without acquire on {w.url}: a router bug")
                w.outstanding -= 1

    def _why_none(self, skip: set[str]) -> str:
        parts = []
        for d in self.decode:
            if d.url in skip:
                parts.append(f"{d.url}: failed this request already")
            elif not d.healthy:
                parts.append(f"{d.url}: unhealthy ({d.last_error})")
            else:
                bad = [
                    str(self.pairs[k].error)
                    for k in self.pair_keys()
                    if k[1] == d.url and self.pairs[k].ok is False
                ]
                parts.append(f"{d.url}: no usable pair ({'; '.join(bad) or 'no healthy prefill'})")
        return "no decode worker in rotation: " + "; ".join(parts)

    # -- what the health checks saw -----------------------------------------------------
    def mark_worker(self, url: str, ok: bool, error: str | None, now: float) -> str | None:
        """Record a liveness result; returns a log line when the worker changed state."""
        w = self.worker(url)
        was = w.healthy
        w.healthy, w.last_check = ok, now
        w.last_error = None if ok else error
        self.changes += was != ok
        if was and not ok:
            self.policy.forget(w.role.value, w.index)
            return f"{w.role.value} worker {url} left rotation: {error}"
        if ok and not was:
            return f"{w.role.value} worker {url} is healthy again and back in rotation"
        return None

    def mark_pair(
        self, key: PairKey, ok: bool, latency_s: float, error: str | None, now: float
    ) -> str | None:
        """Record a deep-check result; returns a log line when the pair changed state."""
        h = self.pairs[key]
        was = h.ok is not False
        h.ok, h.latency_s, h.checked_at = ok, latency_s, now
        h.error = None if ok else error
        if ok:
            h.passes += 1
        else:
            h.failures += 1
        self.changes += was != ok
        name = f"pair (prefill {key[0]}, decode {key[1]})" if key[0] else f"worker {key[1]}"
        if was and not ok:
            return f"deep health failed for {name}; out of rotation: {error}"
        if ok and not was:
            return f"deep health passed again for {name}; back in rotation"
        return None

    def served(self, key: PairKey, now: float) -> None:
        """A client request through the pair finished well: the pair serves, whatever a slow
        canary says (router/health.py tells a canary slowed by load from a failure by this)."""
        h = self.pairs.get(key)
        if h is not None:
            h.served_at = now

    def serving_since(self, key: PairKey, since: float) -> bool:
        """Whether a client request through the pair succeeded at or after `since`."""
        h = self.pairs.get(key)
        return h is not None and h.served_at is not None and h.served_at >= since

    def pairs_to_retry(self, now: float, retry_s: float) -> list[PairKey]:
        """Failed pairs whose workers are alive and whose last probe is older than retry_s."""
        out = []
        for key, h in self.pairs.items():
            if h.ok is not False or (h.checked_at is not None and now - h.checked_at < retry_s):
                continue
            p_url, d_url = key
            if self.worker(d_url).healthy and (p_url is None or self.worker(p_url).healthy):
                out.append(key)
        return out

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        last = self.last_decode_only
        return {
            "policy": self.policy.name,
            "policy_stats": self.policy.stats(),
            "routed_modes": {mode.value: n for mode, n in self.routed_modes.items()},
            "last_decode_only_age_s": None if last is None else round(now - last, 3),
            "workers": [
                {
                    **w.snapshot(now, self.in_rotation(w)),
                    **self.policy.state(w.role.value, w.index),
                }
                for w in self.workers
            ],
            "pairs": [
                {
                    "prefill": k[0],
                    "decode": k[1],
                    "ok": h.ok,
                    "usable": self.pair_usable(k),
                    "latency_ms": None if h.latency_s is None else round(h.latency_s * 1e3, 1),
                    "error": h.error,
                    "passes": h.passes,
                    "failures": h.failures,
                    "age_s": None if h.checked_at is None else round(now - h.checked_at, 3),
                }
                for k, h in self.pairs.items()
            ],
        }
