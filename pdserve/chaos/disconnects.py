"""client-disconnect-at-each-state: a client hangs up while its request is in each state.

The cluster runs with fault points that hold a request in each state for a moment:
P delays each PrefillRequest on receipt (D's room stays *pending*), P stalls before each KV
write (both rooms *prefilling*, mid-write), D stalls between PrefillDone and joining the
decode batch (*kv-done*: P finished, D not decoding yet); *decoding* needs no fault. For each
state, one streaming completion goes through the router; the harness watches the workers'
/debug/state until the request is in that state, then closes the client's socket. Checks,
per state: the router aborts the request down the chain and every worker returns to
quiescence within the bound (no request, no room, every page free), no thread crashed, and a
fresh request succeeds. Repeated for `--rounds` passes over the states.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from pdserve.chaos import probes
from pdserve.chaos.cluster import ClusterSpec, WorkerRef
from pdserve.chaos.scenarios import ChaosOptions, Context, Outcome, percentile
from pdserve.runtime import httpcall

HOLD_S = 1.5  # each fault point holds a request this long
FAULTS = (
    f"control.recv.PrefillRequest=delay:{HOLD_S},p.write=delay:{HOLD_S},"
    f"d.start_decode=delay:{HOLD_S}"
)
SEE_S = 20.0  # a request reaches each state well within this
PROMPT_LEN = 1300  # three prefill chunks of the default 512-token step


def prompt(n: int) -> list[int]:
    """The n-th disconnect's prompt. The engine is asleep inside a held write, so a
    *prefilling* room is visible only between two writes of one prompt: every prompt starts
    with its own token, so no earlier one's pages are in the prefix cache (a cached prefix
    leaves P one chunk to compute and write, and no such window)."""
    return [40 + (i + n) % 3000 for i in range(PROMPT_LEN)]


Roles = dict[str, dict[str, Any]]  # "prefill" / "decode" -> that worker's engine snapshot


def _rooms(roles: Roles, role: str, state: str) -> bool:
    return any(r.get("state") == state for r in roles[role].get("role", {}).get("rooms", []))


def _decoding(roles: Roles) -> bool:
    return any(r.get("state") == "running" for r in roles["decode"].get("requests", []))


STATES: dict[str, Callable[[Roles, int], bool]] = {
    "pending": lambda s, done0: _rooms(s, "decode", "pending"),
    "prefilling": lambda s, done0: _rooms(s, "prefill", "prefilling"),
    "kv-done": lambda s, done0: _prefill_done(s) > done0 and not _decoding(s),
    "decoding": lambda s, done0: _decoding(s),
}


def _prefill_done(roles: Roles) -> int:
    return int(roles["prefill"].get("role", {}).get("stats", {}).get("done", 0))


class ClientDisconnect:
    name = "client-disconnect"
    destructive = False
    needs_launch = True

    def spec(self, opts: ChaosOptions) -> ClusterSpec:
        b = opts.base_spec()
        return ClusterSpec(1, 1, b.backend, b.model, b.threads, env=(("PDSERVE_FAULTS", FAULTS),))

    def unfit(self, workers: list[WorkerRef]) -> str | None:
        roles = {w.role for w in workers}
        return None if {"prefill", "decode"} <= roles else "needs a prefill/decode cluster"

    def run(self, ctx: Context, out: Outcome) -> None:
        router = ctx.cluster.url
        workers = {w.role: w for w in ctx.workers()}
        n = 0  # disconnects so far: each its own prompt
        for rnd in range(ctx.opts.rounds):
            for state, reached in STATES.items():
                rec = self.one(ctx, out, router, workers, state, reached, prompt(n))
                n += 1
                rec["round"] = rnd + 1
                out.rounds.append(rec)
                ctx.say(
                    f"round {rnd + 1}: disconnect in {state}: "
                    + ("ok" if rec.get("ok") else "VIOLATION")
                    + f", quiet after {rec.get('quiet_after_s')}s"
                )
        seen = [r for r in out.rounds if r.get("seen")]
        quiet = [r["quiet_after_s"] for r in out.rounds if r.get("quiet_after_s") is not None]
        out.summary = {
            "headline": (
                f"{len(seen)}/{len(out.rounds)} disconnects landed in their state; "
                f"quiet after p50 {percentile(quiet, 50)}s / max {max(quiet, default=None)}s"
            ),
            "disconnects": len(out.rounds),
            "states": list(STATES),
        }
        if not out.ok:
            out.diagnosis = ctx.diagnose()

    def one(
        self,
        ctx: Context,
        out: Outcome,
        router: str,
        workers: dict[str, WorkerRef],
        state: str,
        reached: Callable[[Roles, int], bool],
        prompt_ids: list[int],
    ) -> dict[str, Any]:
        rec: dict[str, Any] = {"state": state}
        done0 = _prefill_done(snapshot(workers))
        conn = open_stream(router, prompt_ids)
        try:
            t0 = time.monotonic()
            while not (seen := reached(snapshot(workers), done0)):
                if time.monotonic() - t0 > SEE_S:
                    break
                time.sleep(0.05)
            rec["seen"] = seen
            if not seen:
                out.violate(f"disconnect in {state}: the request never reached it in {SEE_S}s")
        finally:
            hang_up(conn)
        quiet = probes.wait_quiet(router, [w.url for w in workers.values()], ctx.opts.quiet_bound_s)
        rec["quiet_after_s"] = quiet.after_s if quiet.ok else None
        if not quiet.ok:
            out.violate(f"disconnect in {state}: not quiet: {'; '.join(quiet.violations)}")
        for w in workers.values():
            bad = probes.dead_threads(w.url)
            if bad:
                out.violate(f"disconnect in {state}: {w.url} threads crashed or dead: {bad}")
        fresh = probes.fresh_completion(router)
        rec["fresh_completion"] = fresh or "ok"
        if fresh:
            out.violate(f"disconnect in {state}: the next request failed: {fresh}")
        rec["ok"] = rec["seen"] and quiet.ok and not fresh
        return rec


def snapshot(workers: dict[str, WorkerRef]) -> Roles:
    out: Roles = {}
    for role, w in workers.items():
        body = httpcall.get(w.url + "/debug/state", 10.0).body
        out[role] = (body or {}).get("engine", {}) if isinstance(body, dict) else {}
    return out


def open_stream(router: str, prompt_ids: list[int]) -> http.client.HTTPConnection:
    """Start a streaming completion and leave it open (the response is never read)."""
    u = urlparse(router)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=30)
    body = {
        "prompt": prompt_ids,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def hang_up(conn: http.client.HTTPConnection) -> None:
    """Close the socket the way a dying client does: no more reads, connection gone."""
    if conn.sock is not None:
        try:
            conn.sock.shutdown(2)
        except OSError:
            pass
    conn.close()
