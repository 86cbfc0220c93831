"""Scenarios on clusters started with fault points in their environment (runtime/faults.py).

thread-crash: prefill-0 of a 2P+1D cluster runs with `thread.control=delay:30`: its control
thread sleeps 30 s before every tick, so its heartbeat is fresh for a moment every 30 s and
stale the rest of the time (a half-alive worker: its HTTP server still answers). Checks:
its /health turns 503 within the heartbeat bound of the last heartbeat and never says 200
while the heartbeat is stale; /health/deep fails exactly its pairs; new requests succeed
through prefill-1; doctor names the stalled thread; the decode worker returns to
quiescence (rooms for the stalled P fence and release).

message-faults: for each of PrefillAccept, PrefillDone, AbortAck and KVChunk (KVChunk only
travels on the tcp backend), a cluster that drops 30% of those messages on receipt
(seeded), a short load with streams abandoned mid-way (so that aborts and their acks
happen); every request ends within its deadline, the invariants hold after the bound, and a
decode worker never starts decoding a request whose KV did not all arrive (tcp: bytes
received == bytes the prefill worker reported).
"""

from __future__ import annotations

import time
from typing import Any

from pdserve.chaos import probes
from pdserve.chaos.cluster import Cluster, ClusterSpec, WorkerRef
from pdserve.chaos.kills import FRESH, GRACE_S, only_victim_fails
from pdserve.chaos.load import LoadProcess, LoadSpec
from pdserve.chaos.scenarios import ChaosOptions, Context, Outcome
from pdserve.runtime import httpcall

STALL = "thread.control=delay:30"
WATCH_S = 40.0  # one whole stall cycle (30 s) and the 5 s heartbeat bound after it
SLACK_S = 1.0  # our polling period and one HTTP round trip
DROPPABLE = ("PrefillAccept", "PrefillDone", "AbortAck", "KVChunk")  # what --messages may name
DROP_P = 0.3
LOAD_S = 6.0


class ThreadCrash:
    name = "thread-crash"
    destructive = True
    needs_launch = True

    def spec(self, opts: ChaosOptions) -> ClusterSpec:
        b = opts.base_spec()
        return ClusterSpec(
            max(2, b.prefill),
            b.decode,
            b.backend,
            b.model,
            b.threads,
            worker_env=(("prefill-0", "PDSERVE_FAULTS", STALL),),
        )

    def unfit(self, workers: list[WorkerRef]) -> str | None:
        return None  # prefill-0 is out of rotation by design; prefill-1 serves

    def run(self, ctx: Context, out: Outcome) -> None:
        victim = ctx.cluster.names["prefill-0"]
        rec: dict[str, Any] = {"victim": victim, "fault": STALL}
        out.rounds.append(rec)
        self.watch_health(ctx, out, rec, victim)
        deep = probes.wait_deep_health(
            ctx.cluster.url, time.monotonic(), 25.0, lambda b: only_victim_fails(b, victim)
        )
        rec["deep_health_after_s"] = deep.passed_after_s
        if deep.passed_after_s is None:
            out.violate(f"/health/deep did not fail exactly {victim}'s pairs: {deep.last}")
        rows = {w["url"]: w for w in ctx.cluster.document()["router"]["workers"]}
        if rows[victim]["in_rotation"]:
            out.violate(f"the router keeps the stalled {victim} in rotation")
        fails = [f for f in (probes.fresh_completion(ctx.cluster.url) for _ in range(FRESH)) if f]
        if fails:
            out.violate(f"{len(fails)} of {FRESH} new requests failed: {fails[0]}")
        words = ctx.diagnose()
        rec["doctor"] = words
        if not any(victim in w and "thread control" in w for w in words):
            out.violate("doctor did not name the stalled control thread of " + victim)
        others = [w.url for w in ctx.workers() if w.url != victim]
        quiet = probes.wait_quiet(ctx.cluster.url, others, ctx.opts.quiet_bound_s)
        rec["quiet_after_s"] = quiet.after_s if quiet.ok else None
        if not quiet.ok:
            out.violate(f"not quiet after {ctx.opts.quiet_bound_s:.0f}s: {quiet.violations}")
        out.summary = {
            "headline": (
                f"{victim} stalled: health red {rec.get('red_at_heartbeat_age_s')}s after its "
                f"last heartbeat (bound {rec.get('heartbeat_timeout_s')}s), deep health "
                f"{'isolates it' if deep.passed_after_s is not None else 'WRONG'}, "
                f"{FRESH - len(fails)}/{FRESH} new ok"
            ),
            **{k: v for k, v in rec.items() if k != "doctor"},
        }

    def watch_health(self, ctx: Context, out: Outcome, rec: dict[str, Any], url: str) -> None:
        """Sample /health and the control heartbeat until one fresh -> stale turn is seen."""
        t0 = time.monotonic()
        seen_fresh = False
        while time.monotonic() - t0 < WATCH_S:
            state = httpcall.get(url + "/debug/state", 5.0).body
            health = httpcall.get(url + "/health", 5.0)
            threads = state.get("threads", []) if isinstance(state, dict) else []
            thread = next((t for t in threads if t["name"] == "control"), None)
            if thread is None:
                out.violate(f"{url}/debug/state shows no control thread: {str(state)[:300]}")
                return
            age, limit = thread["heartbeat_age_s"], thread["heartbeat_timeout_s"]
            rec["heartbeat_timeout_s"] = limit
            if health.ok and age > limit + SLACK_S:
                out.violate(f"/health said 200 with the control heartbeat {age:.1f}s old")
                return
            seen_fresh = seen_fresh or age < limit
            if seen_fresh and not health.ok:
                rec["red_at_heartbeat_age_s"] = round(age, 2)
                rec["problems"] = (health.body or {}).get("problems")
                if age > limit + SLACK_S:
                    out.violate(f"/health turned red only {age:.1f}s after the last heartbeat")
                return
            time.sleep(0.2)
        out.violate(f"no fresh -> stale turn of the control heartbeat seen in {WATCH_S:.0f}s")


class MessageFaults:
    name = "message-faults"
    destructive = True
    needs_launch = True

    def spec(self, opts: ChaosOptions) -> ClusterSpec | None:
        return None  # a cluster per message type, started in run()

    def unfit(self, workers: list[WorkerRef]) -> str | None:
        return None

    def run(self, ctx: Context, out: Outcome) -> None:
        for kind in ctx.opts.messages:
            b = ctx.opts.base_spec()
            backend = "tcp" if kind == "KVChunk" else b.backend
            faults = f"control.recv.{kind}=drop@{DROP_P}"
            env = (("PDSERVE_FAULTS", faults), ("PDSERVE_FAULT_SEED", str(ctx.opts.seed)))
            spec = ClusterSpec(max(1, b.prefill), b.decode, backend, b.model, b.threads, env)
            cluster = ctx.launch(spec)
            try:
                rec = self.one(ctx, out, cluster, kind, backend)
            finally:
                cluster.close()
            rec.update(message=kind, backend=backend)
            out.rounds.append(rec)
        out.summary = {
            "headline": "; ".join(
                f"{r['message']}: {r['client'].get('started', 0)} requests, "
                f"{r['client'].get('failed', 0)} failed, longest "
                f"{r['client'].get('max_request_s', 0):.1f}s, "
                + (f"quiet after {r['quiet_after_s']}s" if r["quiet_after_s"] else "NOT QUIET")
                for r in out.rounds
            )
        }

    def one(
        self, ctx: Context, out: Outcome, cluster: Cluster, kind: str, backend: str
    ) -> dict[str, Any]:
        opts = ctx.opts
        spec = LoadSpec(
            max(1, opts.sessions // 3),
            seed=ctx.rng.randrange(2**31),
            max_tokens=opts.max_tokens,
            timeout_s=opts.request_timeout_s,
            abandon=0.3,
            duration_s=LOAD_S,
        )
        load = LoadProcess(cluster.url, spec, ctx.work_dir / f"drop-{kind}.json").start()
        try:
            load.wait_exit(LOAD_S + opts.request_timeout_s + 45.0)
        finally:
            load.kill()
        client = load.progress()
        rec: dict[str, Any] = {"client": client}
        bound = opts.request_timeout_s + GRACE_S
        if not client.get("finished") or client.get("errors", {}).get("hung"):
            out.violate(f"{kind}: some request never ended ({client.get('errors')})")
        if client.get("max_request_s", 0.0) > bound:
            out.violate(f"{kind}: a request took {client['max_request_s']:.1f}s (bound {bound}s)")
        workers = cluster.workers()
        quiet = probes.wait_quiet(cluster.url, [w.url for w in workers], opts.quiet_bound_s)
        rec["quiet_after_s"] = quiet.after_s if quiet.ok else None
        if not quiet.ok:
            out.violate(f"{kind}: not quiet after {opts.quiet_bound_s:.0f}s: {quiet.violations}")
            out.diagnosis = out.diagnosis or ctx.diagnose(cluster)
        for w in workers:
            role = (httpcall.get(w.url + "/debug/state", 10.0).body or {}).get("engine", {})
            stats = (role.get("role") or {}).get("stats") or {}
            rec.setdefault("stats", {})[w.url] = stats
            # On tcp the KV travels in KVChunk messages and D counts what it received; on
            # shm P writes D's pages directly and D has nothing to count.
            received, acked = stats.get("bytes_written", 0), stats.get("bytes_acked", 0)
            if w.role == "decode" and backend == "tcp" and received < acked:
                out.violate(
                    f"{kind}: decode worker {w.url} received {received} KV bytes but started "
                    f"decoding on {acked}: it decoded requests whose "
                    f"KV never fully arrived"
                )
        return rec
