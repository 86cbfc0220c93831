"""Doctor's reading of a cluster: a pure function from /debug/cluster to findings in words.

Input is the router's /debug/cluster document (the registry, and every worker's
/debug/state or the error fetching it), or a server document (one server read alone, see
source.py); output is a Diagnosis: a line per worker and a list of findings, each with a
severity. The exit code of `pdserve doctor` is the worst severity:

* 0 healthy: every worker answers, every thread is fresh, nothing overdue, no leaked page.
* 1 degraded: the cluster serves, but something is wrong: a worker unreachable or out of
  rotation, a pair failing deep health, a stale or dead thread with no work behind it,
  pages in use that no request or room holds.
* 2 wedged: something cannot make progress: a request or room past its deadline (the
  engine should have ended it), a stale or dead thread (or an engine that does not answer)
  on a worker with live work, a room waiting on a peer whose threads are stale, or no
  usable pair at all, so that the cluster cannot serve a single request.
Requests served decode-only in a cluster that has prefill workers (the router routed them
with no prefill worker, or a decode worker prefilled them itself) are 1 while it happened
in the last RECENT_S, a note before: the counts run from the process's start, and the age
of the last one says whether it still happens.
An unreachable worker is 1 while another pair still serves, and 2 when none does. A server
read alone is judged the same way, worker by itself; its own /health saying unhealthy with
no finding to explain it is 1. No I/O and no clock here: `now_unix` comes in, so fixtures
test it exactly.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

DEADLINE_GRACE_S = 1.0  # deadlines are applied once per engine step; allow one slow step
STUCK_S = 1.0  # waiting on a stalled peer this long: stuck, not just passing
UNREACHABLE = "unreachable"
# Decode room states that wait for the prefill worker's next message (a fenced room waits
# on its own clock only; a prefill worker's rooms wait on nobody).
WAITS_ON_PEER = frozenset({"pending", "prefilling", "aborting"})
RECENT_S = 60.0  # decode-only service this recent is degraded; older, a note


class Severity(enum.IntEnum):
    NOTE = 0
    DEGRADED = 1
    WEDGED = 2


@dataclass(frozen=True)
class Finding:
    severity: Severity
    where: str  # "decode worker http://... (pid N)", "router", "cluster"
    what: str  # plain words: what is wrong, since when, why it matters


@dataclass
class Diagnosis:
    header: str = ""
    workers: list[str] = field(default_factory=list)  # one status line per worker
    findings: list[Finding] = field(default_factory=list)
    details: list[str] = field(default_factory=list)  # e.g. the ranks' last records (flight.py)

    @property
    def code(self) -> int:
        return max((int(f.severity) for f in self.findings), default=0)

    def add(self, severity: Severity, where: str, what: str) -> None:
        self.findings.append(Finding(severity, where, what))

    def verdict(self) -> str:
        worst = [f for f in self.findings if f.severity == self.code and f.severity > 0]
        if not worst:
            return "VERDICT: healthy: every worker answers, nothing is stuck, no page leaked"
        word = "wedged" if self.code == Severity.WEDGED else "degraded"
        more = f" (and {len(worst) - 1} more)" if len(worst) > 1 else ""
        return f"VERDICT: {word}: {worst[0].where}: {worst[0].what}{more}"

    def lines(self) -> list[str]:
        mark = {Severity.NOTE: "-", Severity.DEGRADED: "!", Severity.WEDGED: "!!"}
        out = [self.header, *self.workers]
        out += [f"{mark[f.severity]:>2} {f.where}: {f.what}" for f in self.findings]
        return [*out, *self.details, self.verdict()]

    def to_json(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "verdict": self.verdict(),
            "workers": self.workers,
            "details": self.details,
            "findings": [
                {"severity": f.severity.name.lower(), "where": f.where, "what": f.what}
                for f in self.findings
            ],
        }


def clock(now_unix: float, ago_s: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(now_unix - ago_s))


def diagnose(doc: dict[str, Any], now_unix: float) -> Diagnosis:
    """A router's /debug/cluster document, or a server document (source.py)."""
    if "server" in doc:
        return _diagnose_server(doc, now_unix)
    d = Diagnosis()
    router = doc.get("router") or {}
    rows = router.get("workers") or []
    d.header = (
        f"router pid {router.get('pid')}, up {router.get('uptime_s', 0):.0f}s, "
        f"{router.get('live_requests', 0)} live requests, {len(rows)} workers"
    )
    for p in router.get("problems") or []:
        d.add(Severity.DEGRADED, "router", p)
    # Peers name each other by control address (D -> P) and identity (P -> D).
    names: dict[str, str] = {}
    for w in rows:
        info = w.get("info") or {}
        for key in (info.get("control"), info.get("identity")):
            if key:
                names[key] = w["url"]
    troubled: dict[str, str] = {}  # url -> why it cannot make progress (stale, unreachable)
    states: dict[str, dict[str, Any]] = {}
    for w in rows:
        entry = (doc.get("workers") or {}).get(w["url"]) or {}
        where = f"{w['role']} worker {w['url']} (pid {w.get('pid')})"
        if "state" not in entry:
            troubled[w["url"]] = UNREACHABLE
            d.workers.append(f"{where}: UNREACHABLE ({entry.get('error', 'no state')})")
            d.add(Severity.DEGRADED, where, f"unreachable: {entry.get('error', 'no state')}")
            continue
        states[w["url"]] = entry["state"]
        stale = _threads(d, where, entry["state"], now_unix)
        if stale:
            troubled[w["url"]] = f"thread {', '.join(stale)} stale or dead"
    for w in rows:
        if w["url"] in states:
            where = f"{w['role']} worker {w['url']} (pid {w.get('pid')})"
            _work(d, where, w, states[w["url"]], troubled, names)
    _rotation(d, router)
    _decode_only(d, router, states)
    return d


def _diagnose_server(doc: dict[str, Any], now: float) -> Diagnosis:
    """One server, read without a router: {"server": {"url", "info"}, "state"}."""
    d = Diagnosis()
    server, state = doc["server"], doc["state"]
    info = server.get("info") or {}
    role = str(state.get("role") or info.get("role") or "unknown")
    url = server["url"]
    name = "co-located server" if role == "colocated" else f"{role} worker"
    where = f"{name} {url} (pid {info.get('pid')})"
    d.header = f"{where}, up {float(state.get('uptime_s') or 0):.0f}s, read directly (no router)"
    stale = _threads(d, where, state, now)
    troubled = {url: f"thread {', '.join(stale)} stale or dead"} if stale else {}
    _work(d, where, {"url": url, "role": role}, state, troubled, {})
    if role == "decode":
        why = "no prefill worker was named for them (a router without one, or a direct call)"
        _local_prefills(d, where, state, why)
    problems = state.get("problems") or []
    if problems and d.code == 0:
        d.add(Severity.DEGRADED, where, f"its /health says unhealthy: {'; '.join(problems)}")
    if role != "colocated":
        d.add(
            Severity.NOTE,
            where,
            "read alone: its peers were not checked (point doctor at the router for that)",
        )
    return d


def _threads(d: Diagnosis, where: str, state: dict[str, Any], now: float) -> list[str]:
    """Report dead and stale threads; their names."""
    bad = []
    for t in state.get("threads") or []:
        age, limit = t["heartbeat_age_s"], t["heartbeat_timeout_s"]
        err = f"; last error: {t['last_error']}" if t.get("last_error") else ""
        crashes = f", {t['crashes']} crashes" if t.get("crashes") else ""
        if not t["alive"]:
            bad.append(t["name"])
            d.add(
                Severity.DEGRADED,
                where,
                f"thread {t['name']} is dead since {clock(now, age)} ({t['dead_reason']}"
                f"{crashes}{err})",
            )
        elif age > limit:
            bad.append(t["name"])
            d.add(
                Severity.DEGRADED,
                where,
                f"thread {t['name']} is stale: no heartbeat for {age:.1f}s (since "
                f"{clock(now, age)}; limit {limit:.0f}s{crashes}{err})",
            )
        elif t.get("crashes"):
            d.add(Severity.NOTE, where, f"thread {t['name']} crashed {t['crashes']} times{err}")
    return bad


def _work(
    d: Diagnosis,
    where: str,
    w: dict[str, Any],
    state: dict[str, Any],
    troubled: dict[str, str],
    names: dict[str, str],
) -> None:
    eng = state.get("engine") or {}
    health = "healthy" if not state.get("problems") else "UNHEALTHY"
    if "in_rotation" in w:  # a router's worker; a server read alone has no rotation
        health += ", in rotation" if w["in_rotation"] else ", OUT OF ROTATION"
    if "error" in eng or "pool" not in eng:
        d.workers.append(f"{where}: {health}; engine not answering")
        d.add(Severity.WEDGED, where, f"the engine thread does not answer: {eng.get('error')}")
        return
    role = eng.get("role") or {}
    requests, rooms = eng.get("requests") or [], role.get("rooms") or []
    admitting = int(role.get("admitting") or 0)
    pool = eng["pool"]
    d.workers.append(
        f"{where}: {health}; {len(requests)} requests, {len(rooms)} rooms, "
        f"{admitting} waiting for pages, {pool['pages_used']}/{pool['pages_total']} pages used"
    )
    own = troubled.get(w["url"])
    live = len(requests) + len(rooms) + admitting
    if own is not None and live:
        d.add(Severity.WEDGED, where, f"{own}, with {live} live requests/rooms behind it")
    # Everything live on a worker that cannot make progress is stuck, however new.
    own = None if own is None else f"{own} on this worker"
    for r in requests:
        _item(d, where, f"request {r['request_id']}", r, own)
    for r in rooms:
        peer = names.get(r.get("peer", ""), r.get("peer", "?"))
        label = f"room {r['room']} (request {r.get('request_id', '?')}, peer {peer})"
        waits = w["role"] == "decode" and r["state"] in WAITS_ON_PEER
        if own is not None or not (waits and peer in troubled):
            _item(d, where, label, r, own)
            continue
        # A dead peer is the designed case (the room fences by its deadline); a half-alive
        # one that stopped answering is the wedge LESSONS #6 is about.
        severity = Severity.DEGRADED if troubled[peer] == UNREACHABLE else Severity.WEDGED
        _item(d, where, label, r, f"its peer {peer}: {troubled[peer]}", severity, STUCK_S)
    held = sum(int(r.get("pages") or 0) for r in requests) + sum(
        int(r.get("pages") or 0) for r in rooms
    )
    leaked = int(pool["pages_used"]) - held - int(pool.get("pages_cached") or 0)
    if leaked > 0:
        d.add(
            Severity.DEGRADED,
            where,
            f"{leaked} pages in use that no live request or room holds (leaked)",
        )
    for p in role.get("peers") or []:
        if p.get("refused"):
            peer = names.get(p.get("address", ""), p.get("address"))
            d.add(Severity.NOTE, where, f"peer {peer}: {p['refused']}")


def _item(
    d: Diagnosis,
    where: str,
    label: str,
    r: dict[str, Any],
    blocked: str | None,
    severity: Severity = Severity.WEDGED,
    after_s: float = 0.0,
) -> None:
    """A live request or room: overdue, or stuck (for `after_s` at least) behind a thread
    that cannot run."""
    left = r.get("deadline_in_s")
    in_state = float(r.get("time_in_state_s") or 0.0)
    what = f"{label} in state {r['state']} for {in_state:.1f}s"
    if left is not None and left < -DEADLINE_GRACE_S:
        d.add(Severity.WEDGED, where, f"{what}: {-left:.1f}s past its deadline")
    elif blocked is not None and in_state >= after_s:
        due = f"; deadline in {left:.1f}s" if left is not None else ""
        d.add(severity, where, f"{what}, stuck: {blocked}{due}")


def _rotation(d: Diagnosis, router: dict[str, Any]) -> None:
    for w in router.get("workers") or []:
        if not w.get("in_rotation"):
            why = w.get("last_error") or "no usable pair"
            d.add(Severity.DEGRADED, f"{w['role']} worker {w['url']}", f"out of rotation: {why}")
    pairs = router.get("pairs") or []
    for p in pairs:
        if p.get("ok") is False:
            name = f"pair (prefill {p['prefill']}, decode {p['decode']})"
            d.add(Severity.DEGRADED, name, f"deep health fails: {p.get('error')}")
    if pairs and not any(p.get("usable") for p in pairs):
        d.add(Severity.WEDGED, "cluster", "no (prefill, decode) pair is usable: it cannot serve")


def _decode_only(d: Diagnosis, router: dict[str, Any], states: dict[str, dict[str, Any]]) -> None:
    """Requests served with no prefill worker although the cluster has some: routed so by
    the router, or prefilled by a decode worker itself (its /generate named no prefill)."""
    rows = router.get("workers") or []
    prefill = [w for w in rows if w["role"] == "prefill"]
    if not prefill:
        return
    routed = router.get("routed_modes") or {}
    n = int(routed.get("decode_only") or 0)
    if n:
        total = sum(int(v or 0) for v in routed.values())
        what = (
            f"{n} of {total} requests routed since it started went to a decode worker with no "
            f"prefill worker (decode-only); likely cause: {_prefill_trouble(prefill, states)}"
        )
        _served_decode_only(d, "router", what, router.get("last_decode_only_age_s"))
    why = "their /generate named no prefill worker" + (
        ": the router routed some decode-only (above)"
        if n
        else ", and this router names one: a client or another router calls it directly"
    )
    for w in rows:
        if w["role"] == "decode" and w["url"] in states:
            where = f"decode worker {w['url']} (pid {w.get('pid')})"
            _local_prefills(d, where, states[w["url"]], why)


def _local_prefills(d: Diagnosis, where: str, state: dict[str, Any], why: str) -> None:
    """A decode worker's requests prefilled by itself (its role's `prefill` counts)."""
    counts = _role_state(state).get("prefill") or {}
    local = int(counts.get("local") or 0)
    if local:
        total = local + int(counts.get("remote") or 0)
        what = f"{local} of {total} requests were prefilled here, decode-only: {why}"
        _served_decode_only(d, where, what, counts.get("last_local_age_s"))


def _served_decode_only(d: Diagnosis, where: str, what: str, age_s: Any) -> None:
    recent = isinstance(age_s, (int, float)) and age_s < RECENT_S
    when = f" (the last {float(age_s):.0f}s ago)" if isinstance(age_s, (int, float)) else ""
    d.add(Severity.DEGRADED if recent else Severity.NOTE, where, what + when)


def _prefill_trouble(prefill: list[dict[str, Any]], states: dict[str, dict[str, Any]]) -> str:
    """Why the router may have found no prefill worker: the ones out of rotation now, and
    the PrefillRequests each has refused."""
    out = []
    for w in prefill:
        if not w.get("healthy", True) or not w.get("in_rotation", True):
            state = "unhealthy" if not w.get("healthy", True) else "out of rotation"
            err = f": {w['last_error']}" if w.get("last_error") else ""
            out.append(f"prefill worker {w['url']} {state}{err}")
        stats = _role_state(states.get(w["url"])).get("stats") or {}
        if int(stats.get("rejected") or 0):
            out.append(f"prefill worker {w['url']} refused {stats['rejected']} PrefillRequests")
    return "; ".join(out) or "no prefill worker in rotation at the time (all healthy now)"


def _role_state(state: dict[str, Any] | None) -> dict[str, Any]:
    """A worker's /debug/state role section ({} if it has none)."""
    return ((state or {}).get("engine") or {}).get("role") or {}
