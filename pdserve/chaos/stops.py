"""prefill-stop: SIGSTOP one prefill worker of two under load, later SIGCONT it.

A stopped process is the hard case: its sockets stay open, nothing fails, it just stops
answering (and NIXL has no timeout of its own for a transfer to or from it). Checks:
  * /health/deep shows exactly the stopped worker's pairs failing;
  * every request ends within its own deadline (D declares the silent P dead after 5 s and
    fails its rooms), and new requests succeed through the healthy P;
  * D's rooms with the stopped P are fenced (pages held, not freed) and are released once the
    fence expires, while P is still stopped;
  * after SIGCONT the worker returns: /health/deep passes for every pair again, and every
    worker, the resumed one included, returns to quiescence (its own rooms are closed).
"""

from __future__ import annotations

import signal
import time
from typing import Any

from pdserve.chaos import probes
from pdserve.chaos.cluster import ClusterSpec, WorkerRef
from pdserve.chaos.kills import DEEP_BOUND_S, FRESH, WorkerKill, only_victim_fails
from pdserve.chaos.load import LoadProcess
from pdserve.chaos.scenarios import ChaosOptions, Context, Outcome
from pdserve.runtime import httpcall

AFTER_STOP_S = 8.0  # load keeps running this long after the stop: past D's 5 s P timeout
FENCE_SLACK_S = 20.0  # D's fence: >= 10 s, and write deadline (<= request timeout) + 2 s
RESUME_BOUND_S = 30.0  # SIGCONT -> every pair passes deep health again


class PrefillStop:
    destructive = True
    needs_launch = False
    name = "prefill-stop"

    def __init__(self) -> None:
        self._kill = WorkerKill("prefill")  # same cluster shape and request checks

    def spec(self, opts: ChaosOptions) -> ClusterSpec:
        return self._kill.spec(opts)

    def unfit(self, workers: list[WorkerRef]) -> str | None:
        return self._kill.unfit(workers)

    def run(self, ctx: Context, out: Outcome) -> None:
        opts = ctx.opts
        router = ctx.cluster.url
        workers = ctx.workers()
        victim = ctx.rng.choice([w for w in workers if w.role == "prefill"])
        decoders = [w for w in workers if w.role == "decode"]
        delay = round(ctx.rng.uniform(*opts.kill_after), 3)
        spec = opts.load(ctx.rng.randrange(2**31), duration_s=delay + AFTER_STOP_S)
        rec: dict[str, Any] = {"victim": victim.url, "pid": victim.pid, "stop_after_s": delay}
        out.rounds.append(rec)
        load = LoadProcess(router, spec, ctx.work_dir / f"{self.name}.json").start()
        stopped = False
        try:
            if not load.wait_loaded():
                out.violate(f"the chaos client never started its load: {load.log_tail()}")
                return
            time.sleep(delay)
            t_stop = ctx.cluster.send_signal(victim, signal.SIGSTOP)
            stopped = True
            ctx.say(f"SIGSTOPped prefill worker {victim.url} (pid {victim.pid}) after {delay}s")
            deep = probes.wait_deep_health(
                router, t_stop, DEEP_BOUND_S, lambda body: only_victim_fails(body, victim.url)
            )
            rec["deep_health_after_s"] = deep.passed_after_s
            if deep.passed_after_s is None:
                out.violate(
                    f"/health/deep never showed exactly {victim.url}'s pairs failing within "
                    f"{DEEP_BOUND_S:.0f}s; last: {deep.last}"
                )
            rec["client_exit"] = load.wait_exit(delay + AFTER_STOP_S + opts.request_timeout_s + 20)
            self._kill.check_requests(ctx, out, rec, load.progress())
            fails = [f for f in (probes.fresh_completion(router) for _ in range(FRESH)) if f]
            rec["fresh_failed"] = fails
            if fails:
                out.violate(f"{len(fails)} of {FRESH} new requests failed while P was stopped")
            self.check_fences(ctx, out, rec, victim, decoders, t_stop)
        finally:
            load.kill()
            if stopped:
                ctx.cluster.send_signal(victim, signal.SIGCONT)
        t_cont = time.monotonic()
        back = probes.wait_deep_health(router, t_cont, RESUME_BOUND_S)
        rec["deep_health_after_resume_s"] = back.passed_after_s
        if back.passed_after_s is None:
            out.violate(f"after SIGCONT, /health/deep never passed again: {back.last}")
        quiet = probes.wait_quiet(router, [w.url for w in workers], opts.quiet_bound_s)
        rec["quiet_after_s"] = quiet.after_s if quiet.ok else None
        rec["leaked_pages"] = quiet.leaked_pages
        if not quiet.ok:
            out.violate(f"not quiet after {opts.quiet_bound_s:.0f}s: {'; '.join(quiet.violations)}")
        if not out.ok:
            out.diagnosis = ctx.diagnose()
        client = rec.get("client", {})
        out.summary = {
            "headline": (
                f"stopped {victim.url}; deep health {rec['deep_health_after_s']}s after the stop, "
                f"{rec['deep_health_after_resume_s']}s after SIGCONT; "
                f"{client.get('started', 0)} requests, failed {client.get('errors')}, "
                f"longest {client.get('max_request_s', 0):.1f}s; fenced rooms "
                f"{rec.get('fenced_rooms_seen', 0)}, released after "
                f"{rec.get('fences_released_after_s')}s; "
                + (f"quiet after {quiet.after_s:.1f}s" if quiet.ok else "NOT QUIET")
            ),
            **{
                k: rec.get(k)
                for k in (
                    "deep_health_after_s",
                    "deep_health_after_resume_s",
                    "fenced_rooms_seen",
                    "fences_released_after_s",
                    "quiet_after_s",
                    "leaked_pages",
                )
            },
        }
        ctx.say(out.summary["headline"])

    def check_fences(
        self,
        ctx: Context,
        out: Outcome,
        rec: dict[str, Any],
        victim: WorkerRef,
        decoders: list[WorkerRef],
        t_stop: float,
    ) -> None:
        """While P is still stopped, D's rooms with it end (fenced, then released)."""
        bound = ctx.opts.request_timeout_s + FENCE_SLACK_S
        fenced_seen = 0
        left: list[str] = []
        while True:
            left = []
            for d in decoders:
                r = httpcall.get(d.url + "/debug/state", 10.0)
                role = ((r.body or {}).get("engine") or {}).get("role") or {}
                mine = [x for x in role.get("rooms", []) if x.get("peer") == victim.control]
                fenced_seen = max(fenced_seen, sum(x.get("state") == "fenced" for x in mine))
                bad = [x for x in mine if x.get("state") == "fenced" and not x.get("pages")]
                if bad:
                    out.violate(f"{d.url}: a fenced room holds no pages: {bad[0]}")
                if mine:
                    left.append(f"{d.url} has {len(mine)} rooms with the stopped P")
            elapsed = time.monotonic() - t_stop
            if not left:
                rec["fences_released_after_s"] = round(elapsed, 3)
                break
            if elapsed > bound:
                out.violate(f"{bound:.0f}s after the stop: {'; '.join(left)}")
                break
            time.sleep(0.5)
        rec["fenced_rooms_seen"] = fenced_seen
