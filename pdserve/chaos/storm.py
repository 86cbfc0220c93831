"""abort-storm: SIGKILL a client holding `--sessions` streaming chats, then prove recovery.

Each round: start the chaos client (every session a streaming multi-turn chat, a few
streams closed early on purpose), let it run for a seeded random time in --kill-after,
SIGKILL it, and then, each against its bound:
  1. /health/deep passes (a real request through every pair) within `deep_bound_s` of the
     kill; the time to the first pass is recorded;
  2. a fresh completion succeeds;
  3. quiescence: every worker's invariants hold and the router holds nothing.
A round that misses 1 (at all, within the long bound), 2 or 3 is a wedge. Throughput
(tokens/s delivered to the client) is recorded per round. With `steady_s` > 0, the same
steady load (no kill, no abandoned streams, one seed) runs for `steady_s` on the fresh
cluster before round 1 and again after the last round; after-storm over fresh, like the last
round's over the first's, must stay above `min_throughput_ratio`: a storm must not leave the
cluster slower (LESSONS #8: elsewhere it fell to a fifteenth).
"""

from __future__ import annotations

import time
from typing import Any

from pdserve.chaos import probes
from pdserve.chaos.cluster import ClusterError, ClusterSpec, WorkerRef
from pdserve.chaos.load import LoadProcess
from pdserve.chaos.scenarios import ChaosOptions, Context, Outcome, percentile

WEDGE_BOUND_S = 30.0  # how long we keep polling deep health to tell slow from wedged


class AbortStorm:
    name = "abort-storm"
    destructive = False
    needs_launch = False

    def spec(self, opts: ChaosOptions) -> ClusterSpec:
        return opts.base_spec()

    def unfit(self, workers: list[WorkerRef]) -> str | None:
        return None  # any serving cluster

    def run(self, ctx: Context, out: Outcome) -> None:
        opts = ctx.opts
        fresh = self.steady(ctx, "fresh")
        for i in range(1, opts.rounds + 1):
            rec = self.round(ctx, i)
            out.rounds.append(rec)
            for v in rec["violations"]:
                out.violate(f"round {i}: {v}")
            if rec["violations"] and not out.diagnosis:
                out.diagnosis = ctx.diagnose()
        out.summary = s = summarize(out.rounds, opts)
        after = self.steady(ctx, "after-storm")
        s["steady_fresh_tok_s"], s["steady_after_storm_tok_s"] = fresh, after
        s["steady_ratio"] = round(after / fresh, 3) if fresh and after is not None else None
        s["headline"] = (
            f"{s['rounds']} rounds, {s['wedges']} wedges, {s['leaked_pages']} leaked pages, "
            f"{s['leaked_state_slots']} leaked state slots, "
            f"kill->deep health p50 {fmt(s['kill_to_deep_health_p50_s'])} "
            f"p99 {fmt(s['kill_to_deep_health_p99_s'])} (bound {opts.deep_bound_s:g}s), "
            f"throughput {s['throughput_first_tok_s']} -> {s['throughput_last_tok_s']} tok/s "
            f"(x{s['throughput_ratio']})"
            + (
                f"; steady load fresh {fresh} -> after the storm {after} tok/s "
                f"(x{s['steady_ratio']})"
                if opts.steady_s > 0
                else ""
            )
        )
        ratio = s["throughput_ratio"]
        if ratio is not None and ratio < opts.min_throughput_ratio:
            out.violate(
                f"throughput fell: last round {out.summary['throughput_last_tok_s']} tok/s is "
                f"{ratio:.2f} of the first's {out.summary['throughput_first_tok_s']} "
                f"(bound {opts.min_throughput_ratio})"
            )
        if opts.steady_s > 0 and (fresh is None or after is None):
            out.violate("a steady load run did not complete (see the steady-*.log files)")
        elif s["steady_ratio"] is not None and s["steady_ratio"] < opts.min_throughput_ratio:
            out.violate(
                f"throughput fell: the steady load ran at {after} tok/s after the storm, "
                f"{s['steady_ratio']:.2f} of {fresh} on the fresh cluster"
            )

    def steady(self, ctx: Context, tag: str) -> float | None:
        """tokens/s of the steady load (same seed each time); None if off or it failed."""
        opts = ctx.opts
        if opts.steady_s <= 0:
            return None
        spec = opts.load(opts.seed, duration_s=opts.steady_s)
        load = LoadProcess(ctx.cluster.url, spec, ctx.work_dir / f"steady-{tag}.json").start()
        try:
            if not load.wait_loaded():
                return None
            code = load.wait_exit(opts.steady_s + opts.request_timeout_s + 20)
        finally:
            load.kill()
        progress = load.progress()
        tok_s = progress.get("tokens_per_s") if code == 0 else None
        ctx.say(f"steady load on the {tag} cluster: {tok_s} tok/s, {progress.get('errors')}")
        return tok_s

    def round(self, ctx: Context, i: int) -> dict[str, Any]:
        opts = ctx.opts
        router = ctx.cluster.url
        workers = [w.url for w in ctx.workers()]
        delay = round(ctx.rng.uniform(*opts.kill_after), 3)
        spec = opts.load(ctx.rng.randrange(2**31), abandon=opts.abandon)
        rec: dict[str, Any] = {"round": i, "kill_after_s": delay, "violations": []}
        bad: list[str] = rec["violations"]
        load = LoadProcess(router, spec, ctx.work_dir / f"storm-{i}.json").start()
        try:
            if not load.wait_loaded():
                bad.append(f"the chaos client never started its load: {load.log_tail()}")
                return rec
            time.sleep(delay)
            killed = load.kill()
        finally:
            load.kill()
        client = load.progress()
        rec["client"] = client
        rec["throughput_tok_s"] = client.get("tokens_per_s")
        failed = {k: v for k, v in client.get("errors", {}).items() if v}
        if failed:
            bad.append(f"{sum(failed.values())} requests failed before the kill: {failed}")

        deep = probes.wait_deep_health(router, killed, WEDGE_BOUND_S)
        rec["kill_to_deep_health_s"] = deep.passed_after_s
        rec["deep_health_calls"] = deep.calls
        if deep.passed_after_s is None:
            rec["deep_health_last"] = deep.last
            bad.append(f"wedged: /health/deep did not pass within {WEDGE_BOUND_S:.0f}s")
        elif deep.passed_after_s > opts.deep_bound_s:
            bad.append(
                f"/health/deep passed {deep.passed_after_s:.2f}s after the kill "
                f"(bound {opts.deep_bound_s}s)"
            )
        fresh = probes.fresh_completion(router)
        rec["fresh_completion"] = fresh or "ok"
        if fresh is not None:
            bad.append(f"a fresh completion failed: {fresh}")
        quiet = probes.wait_quiet(router, workers, opts.quiet_bound_s)
        rec["quiet_after_s"] = quiet.after_s if quiet.ok else None
        rec["leaked_pages"] = quiet.leaked_pages
        rec["leaked_state_slots"] = quiet.leaked_state_slots
        if not quiet.ok:
            rec["invariants"] = quiet.workers
            bad.append(f"not quiet after {opts.quiet_bound_s:.0f}s: {'; '.join(quiet.violations)}")
        rec["wedged"] = deep.passed_after_s is None or fresh is not None or not quiet.ok
        rec["worker_stats"] = role_stats(ctx)  # cumulative: aborts, stale events, ...
        ctx.say(
            f"round {i}/{opts.rounds}: {client.get('started', 0)} requests, "
            f"{rec['throughput_tok_s']} tok/s, killed after {delay:.1f}s with "
            f"{client.get('in_flight', '?')} streams open; deep health "
            + (
                f"ok after {deep.passed_after_s:.2f}s"
                if deep.passed_after_s is not None
                else "NEVER"
            )
            + f"; fresh {rec['fresh_completion']}; "
            + (f"quiet after {quiet.after_s:.2f}s" if quiet.ok else "NOT QUIET")
            + (f" -- {len(bad)} violation(s)" if bad else "")
        )
        return rec


def summarize(rounds: list[dict[str, Any]], opts: ChaosOptions) -> dict[str, Any]:
    deep = [
        r["kill_to_deep_health_s"] for r in rounds if r.get("kill_to_deep_health_s") is not None
    ]
    tput = [r.get("throughput_tok_s") for r in rounds]
    first, last = (tput[0], tput[-1]) if tput else (None, None)
    clients = [r.get("client") or {} for r in rounds]
    return {
        "rounds": len(rounds),
        "sessions": opts.sessions,
        "wedges": sum(1 for r in rounds if r.get("wedged")),
        "leaked_pages": sum(r.get("leaked_pages", 0) for r in rounds),
        "leaked_state_slots": sum(r.get("leaked_state_slots", 0) for r in rounds),
        "kill_to_deep_health_p50_s": percentile(deep, 50),
        "kill_to_deep_health_p99_s": percentile(deep, 99),
        "kill_to_deep_health_max_s": max(deep) if deep else None,
        "deep_health_bound_s": opts.deep_bound_s,
        "throughput_first_tok_s": first,
        "throughput_last_tok_s": last,
        "throughput_ratio": round(last / first, 3) if first and last is not None else None,
        "requests": sum(c.get("started", 0) for c in clients),
        "requests_ok": sum(c.get("ok", 0) for c in clients),
        "requests_abandoned": sum(c.get("abandoned", 0) for c in clients),
        "streams_killed": sum(c.get("in_flight", 0) for c in clients),
    }


def fmt(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.2f}s"


def role_stats(ctx: Context) -> dict[str, Any]:
    """Each worker's role counters (cumulative since it started), for the report."""
    try:
        doc = ctx.cluster.document()
    except ClusterError as e:
        return {"error": str(e)}
    out = {}
    for url, w in doc["workers"].items():
        role = ((w.get("state") or {}).get("engine") or {}).get("role") or {}
        out[url] = {"role": w["role"], **(role.get("stats") or {})}
    return out
