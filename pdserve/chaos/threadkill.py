"""thread-kill: every supervised thread of a prefill and a decode worker killed in turn.

The cluster (2P+2D) takes fault points at run time (`--debug-faults`); the harness sets
`thread.<name>=kill:1#1` on one worker (its next tick raises; the supervisor restarts the
thread) and clears it once it fired. For each thread of prefill-0 and decode-0:
  * with restart: the thread is alive again with one more crash on its record, the worker's
    /health is 200 within the heartbeat bound, and a fresh request succeeds.
Then without restart (`kill:0#1`), the prefill worker's control thread and the decode
worker's engine thread:
  * the process never answers /health 200 while a thread is dead, and exits non-zero (as
    its launcher reports) within EXIT_BOUND_S: never a half-alive process;
  * the router routes around it: fresh requests succeed through the other workers, and the
    survivors return to quiescence.
"""

from __future__ import annotations

import time
from typing import Any

from pdserve.chaos import probes
from pdserve.chaos.cluster import ClusterSpec, WorkerRef
from pdserve.chaos.scenarios import ChaosOptions, Context, Outcome
from pdserve.runtime import httpcall
from pdserve.runtime.pids import pid_alive

FIRE_BOUND_S = 10.0  # a set fault fires on the thread's next tick (at most ~0.1 s away)
HEALTH_BOUND_S = 6.0  # a restarted thread's heartbeat is fresh again (bound 5 s) by then
EXIT_BOUND_S = 15.0  # a dead thread -> the process has exited (its drain is skipped)
FOR_GOOD = {"prefill": "control", "decode": "engine"}


class ThreadKill:
    name = "thread-kill"
    destructive = True
    needs_launch = True  # the workers must take run-time faults (--debug-faults)

    def spec(self, opts: ChaosOptions) -> ClusterSpec:
        b = opts.base_spec()
        return ClusterSpec(
            max(2, b.prefill), max(2, b.decode), b.backend, b.model, b.threads, debug_faults=True
        )

    def unfit(self, workers: list[WorkerRef]) -> str | None:
        for role in ("prefill", "decode"):
            if sum(w.role == role for w in workers) < 2:
                return f"needs 2 {role} workers"
        return None

    def run(self, ctx: Context, out: Outcome) -> None:
        workers = ctx.workers()
        victims = [next(w for w in workers if w.role == r) for r in ("prefill", "decode")]
        for w in victims:
            for thread in thread_names(w):
                rec = self.restarted(ctx, out, w, thread)
                out.rounds.append(rec)
                ctx.say(
                    f"{w.role} {w.url}: killed thread {thread} with restart: "
                    + ("ok" if rec["ok"] else "VIOLATION")
                )
        for w in victims:
            rec = self.killed_for_good(ctx, out, w, FOR_GOOD[w.role])
            out.rounds.append(rec)
            ctx.say(
                f"{w.role} {w.url}: killed thread {rec['thread']} for good: exited "
                f"{rec.get('exit_code')} after {rec.get('exited_after_s')}s"
            )
        survivors = [w.url for w in workers if w not in victims]
        quiet = probes.wait_quiet(ctx.cluster.url, survivors, ctx.opts.quiet_bound_s)
        if not quiet.ok:
            out.violate(f"survivors not quiet: {'; '.join(quiet.violations)}")
        restarted = [r for r in out.rounds if r["restart"]]
        out.summary = {
            "headline": (
                f"{sum(r['ok'] for r in restarted)}/{len(restarted)} threads restarted and "
                f"served; killed for good: "
                + ", ".join(
                    f"{r['role']} {r['thread']} exited {r.get('exit_code')}"
                    for r in out.rounds
                    if not r["restart"]
                )
            ),
            "threads_restarted": len(restarted),
        }
        if not out.ok:
            out.diagnosis = ctx.diagnose()

    def restarted(self, ctx: Context, out: Outcome, w: WorkerRef, thread: str) -> dict[str, Any]:
        rec: dict[str, Any] = {"role": w.role, "thread": thread, "restart": True, "ok": False}
        before = crashes(w, thread)
        if not fire(w, f"thread.{thread}=kill:1#1", f"thread.{thread}"):
            out.violate(f"{w.url}: thread.{thread}=kill:1 never fired within {FIRE_BOUND_S}s")
            return rec
        t0 = time.monotonic()
        while True:
            health = httpcall.get(w.url + "/health", 5.0)
            row = thread_row(w, thread)
            if health.ok and row is not None and row["alive"] and row["crashes"] > before:
                rec["healthy_after_s"] = round(time.monotonic() - t0, 3)
                break
            if time.monotonic() - t0 > HEALTH_BOUND_S:
                out.violate(
                    f"{w.url}: after killing {thread} with restart: health {health.status}, "
                    f"thread {row}"
                )
                return rec
            time.sleep(0.1)
        fresh = probes.fresh_completion(ctx.cluster.url)
        rec["fresh_completion"] = fresh or "ok"
        if fresh:
            out.violate(f"{w.url}: after restarting {thread}, a new request failed: {fresh}")
        rec["ok"] = fresh is None
        return rec

    def killed_for_good(
        self, ctx: Context, out: Outcome, w: WorkerRef, thread: str
    ) -> dict[str, Any]:
        rec: dict[str, Any] = {"role": w.role, "thread": thread, "restart": False, "ok": False}
        t0 = time.monotonic()
        set_faults(w, f"thread.{thread}=kill:0#1")
        while w.pid is not None and pid_alive(w.pid):
            state = httpcall.get(w.url + "/debug/state", 2.0).body
            health = httpcall.get(w.url + "/health", 2.0)
            threads = state.get("threads", []) if isinstance(state, dict) else []
            dead = [t["name"] for t in threads if not t["alive"]]
            if dead and health.ok:
                out.violate(f"{w.url}: /health said 200 with thread(s) {dead} dead")
            if time.monotonic() - t0 > EXIT_BOUND_S:
                out.violate(f"{w.url}: still running {EXIT_BOUND_S}s after {thread} died")
                return rec
            time.sleep(0.05)
        rec["exited_after_s"] = round(time.monotonic() - t0, 3)
        code = wait_exit_code(ctx, w.pid)
        rec["exit_code"] = code
        if code is not None and code == 0:
            out.violate(f"{w.url}: exited 0 after thread {thread} died (must be non-zero)")
        fresh = probes.fresh_completion(ctx.cluster.url)
        rec["fresh_completion"] = fresh or "ok"
        if fresh:
            out.violate(f"after {w.url} died, a new request failed: {fresh}")
        rec["ok"] = fresh is None and code != 0
        return rec


def wait_exit_code(ctx: Context, pid: int | None, bound_s: float = 5.0) -> int | None:
    """The exit status the launcher reported for `pid` (it logs it right after reaping)."""
    t0 = time.monotonic()
    while pid is not None and time.monotonic() - t0 < bound_s:
        code = ctx.cluster.exit_code(pid)
        if code is not None:
            return code
        time.sleep(0.1)
    return None


def thread_names(w: WorkerRef) -> list[str]:
    state = httpcall.get(w.url + "/debug/state", 10.0).body or {}
    return [t["name"] for t in state.get("threads", [])]


def thread_row(w: WorkerRef, name: str) -> dict[str, Any] | None:
    state = httpcall.get(w.url + "/debug/state", 5.0).body
    rows = state.get("threads", []) if isinstance(state, dict) else []
    return next((t for t in rows if t["name"] == name), None)


def crashes(w: WorkerRef, name: str) -> int:
    row = thread_row(w, name)
    return int(row["crashes"]) if row else 0


def set_faults(w: WorkerRef, spec: str) -> None:
    httpcall.call("POST", w.url + "/debug/faults", {"spec": spec, "seed": 0}, 5.0)


def fire(w: WorkerRef, spec: str, point: str) -> bool:
    """Set one fault on a worker, wait until it fired once, then clear it."""
    set_faults(w, spec)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < FIRE_BOUND_S:
            body = httpcall.get(w.url + "/debug/faults", 5.0).body
            if isinstance(body, dict) and body.get("fired", {}).get(point):
                return True
            time.sleep(0.05)
        return False
    finally:
        set_faults(w, "")
