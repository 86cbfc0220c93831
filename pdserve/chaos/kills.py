"""prefill-kill and decode-kill: SIGKILL one worker under load; the rest must carry on.

One round each (a kill spends the cluster). Under load from the chaos client, a seeded
choice of worker of the role is SIGKILLed after a seeded delay. Then:
  * every request ends, success or error, within its own deadline: none hangs, whether it
    was on the dead worker (D fails it once P is declared dead; the router ends a stream
    whose D vanished) or not;
  * /health/deep shows exactly the dead worker's pairs failing, the others passing;
  * new requests succeed (the router routes around the dead worker);
  * the survivors return to quiescence: decode-kill also waits for the prefill worker to
    drop the dead D (P declares a D dead after 15 s of silence) and its rooms for it.
"""

from __future__ import annotations

import glob
import os
import time
from typing import Any

from pdserve.chaos import probes
from pdserve.chaos.cluster import ClusterSpec, WorkerRef
from pdserve.chaos.load import LoadProcess
from pdserve.chaos.scenarios import ChaosOptions, Context, Outcome
from pdserve.runtime import httpcall

AFTER_KILL_S = 8.0  # load keeps running this long after the kill: past D's 5 s P timeout
DEEP_BOUND_S = 25.0  # a probe through a dead P ends when D declares it dead (5 s)
P_FORGETS_D_S = 25.0  # P drops a silent D after 15 s
FRESH = 5  # new requests that must all succeed after the kill
GRACE_S = 5.0  # the router's grace past a request's own timeout


class WorkerKill:
    destructive = True
    needs_launch = False

    def __init__(self, role: str) -> None:
        self.role = role
        self.name = f"{role}-kill"

    def spec(self, opts: ChaosOptions) -> ClusterSpec:
        base = opts.base_spec()
        if self.role == "prefill":
            return ClusterSpec(
                max(2, opts.prefill), opts.decode, base.backend, base.model, base.threads
            )
        return ClusterSpec(
            max(1, opts.prefill), max(2, opts.decode), base.backend, base.model, base.threads
        )

    def unfit(self, workers: list[WorkerRef]) -> str | None:
        mine = [w for w in workers if w.role == self.role]
        if len(mine) < 2 or not any(w.role == "prefill" for w in workers):
            return f"needs a prefill/decode cluster with 2 healthy {self.role} workers"
        return None

    def run(self, ctx: Context, out: Outcome) -> None:
        opts = ctx.opts
        router = ctx.cluster.url
        workers = ctx.workers()
        victim = ctx.rng.choice([w for w in workers if w.role == self.role])
        survivors = [w for w in workers if w.url != victim.url]
        delay = round(ctx.rng.uniform(*opts.kill_after), 3)
        spec = opts.load(ctx.rng.randrange(2**31), duration_s=delay + AFTER_KILL_S)
        rec: dict[str, Any] = {"victim": victim.url, "pid": victim.pid, "kill_after_s": delay}
        out.rounds.append(rec)
        load = LoadProcess(router, spec, ctx.work_dir / f"{self.name}.json").start()
        try:
            if not load.wait_loaded():
                out.violate(f"the chaos client never started its load: {load.log_tail()}")
                return
            time.sleep(delay)
            killed = ctx.cluster.kill(victim)
            ctx.say(f"SIGKILLed {self.role} worker {victim.url} (pid {victim.pid}) after {delay}s")
            deep = probes.wait_deep_health(
                router, killed, DEEP_BOUND_S, lambda body: only_victim_fails(body, victim.url)
            )
            rec["deep_health_after_s"] = deep.passed_after_s
            if deep.passed_after_s is None:
                out.violate(
                    f"/health/deep never showed exactly {victim.url}'s pairs failing within "
                    f"{DEEP_BOUND_S:.0f}s; last: {deep.last}"
                )
            # The client stops starting requests at its duration, then lets open ones end.
            rec["client_exit"] = load.wait_exit(delay + AFTER_KILL_S + opts.request_timeout_s + 20)
        finally:
            load.kill()
        self.check_requests(ctx, out, rec, load.progress())
        fails = [f for f in (probes.fresh_completion(router) for _ in range(FRESH)) if f]
        rec["fresh_failed"] = fails
        if fails:
            out.violate(f"{len(fails)} of {FRESH} new requests failed after the kill: {fails[0]}")
        if self.role == "decode":
            self.check_prefill_forgets(ctx, out, rec, victim, survivors)
            rec["notes"] = reap_shm(victim.pid)
        quiet = probes.wait_quiet(router, [w.url for w in survivors], opts.quiet_bound_s)
        rec["quiet_after_s"] = quiet.after_s if quiet.ok else None
        rec["leaked_pages"] = quiet.leaked_pages
        if not quiet.ok:
            out.violate(f"not quiet after {opts.quiet_bound_s:.0f}s: {'; '.join(quiet.violations)}")
        if not out.ok:
            out.diagnosis = ctx.diagnose()
        client = rec["client"]
        out.summary = {
            "headline": (
                f"killed {victim.url}; deep health right after {rec['deep_health_after_s']}s; "
                f"{client.get('started', 0)} requests, failed {client.get('errors')}, "
                f"longest {client.get('max_request_s', 0):.1f}s; "
                f"{FRESH - len(fails)}/{FRESH} new ok; "
                + (f"quiet after {quiet.after_s:.1f}s" if quiet.ok else "NOT QUIET")
            ),
            **{k: rec.get(k) for k in ("deep_health_after_s", "quiet_after_s", "leaked_pages")},
        }
        ctx.say(out.summary["headline"])

    def check_requests(
        self, ctx: Context, out: Outcome, rec: dict[str, Any], client: dict[str, Any]
    ) -> None:
        rec["client"] = client
        bound = ctx.opts.request_timeout_s + GRACE_S
        if not client.get("finished"):
            out.violate("the chaos client did not finish its run: some request never ended")
        if client.get("errors", {}).get("hung"):
            out.violate(f"{client['errors']['hung']} requests hung past their deadline")
        if client.get("max_request_s", 0.0) > bound:
            out.violate(
                f"a request took {client['max_request_s']:.1f}s, past its deadline ({bound:.0f}s)"
            )

    def check_prefill_forgets(
        self,
        ctx: Context,
        out: Outcome,
        rec: dict[str, Any],
        victim: WorkerRef,
        survivors: list[WorkerRef],
    ) -> None:
        """Each P drops the dead D from its peers, and every room it had for it."""
        t0 = time.monotonic()
        left: list[str] = []
        while time.monotonic() - t0 < P_FORGETS_D_S:
            left = []
            for p in (w for w in survivors if w.role == "prefill"):
                r = httpcall.get(p.url + "/debug/state", 10.0)
                role = ((r.body or {}).get("engine") or {}).get("role") or {}
                if any(x.get("identity") == victim.identity for x in role.get("peers", [])):
                    left.append(f"{p.url} still has {victim.identity} as a peer")
                if any(x.get("peer") == victim.identity for x in role.get("rooms", [])):
                    left.append(f"{p.url} still has rooms for {victim.identity}")
            if not left:
                rec["prefill_forgot_after_s"] = round(time.monotonic() - t0, 3)
                return
            time.sleep(0.5)
        out.violate(f"after {P_FORGETS_D_S:.0f}s: {'; '.join(left)}")


def only_victim_fails(body: dict[str, Any], victim: str) -> bool:
    pairs = probes.pair_results(body)
    return bool(pairs) and all(ok == (victim not in key) for key, ok in pairs.items())


def reap_shm(pid: int | None) -> list[str]:
    """A SIGKILLed decode worker cannot unlink its shared KV pool: note it, then remove it,
    so that a chaos run does not leave RAM-backed files behind on the machine."""
    notes = []
    for path in glob.glob(f"/dev/shm/pdserve-kv-{pid}-*"):
        size = os.path.getsize(path) // 2**20
        os.unlink(path)
        notes.append(f"{path} ({size} MiB) outlived the killed decode worker; chaos removed it")
    return notes
