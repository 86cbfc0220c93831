"""tp-desync and tp-rank-kill: a tensor-parallel worker's ranks part under load (LESSONS #12, #21).

One round each, on a cluster of their own (composed, chaos/composed.py): colocated-0 serves at
`--tp 2` (rank 1 a process of its own, gloo on the CPU) with a flight directory,
colocated-1 at TP 1, a router over both. Under the chaos client's load through the router, and
WATCHERS long requests of the harness's own straight to colocated-0 (so that some are in flight
there when the fault comes):
  * tp-desync: rank 1 reads a plan other than the one the leader sent (fault point
    `tp.recv.1=malformed`, in colocated-0's environment, its seed chosen so that it fires on
    one of rank 1's forward records FIRE_AFTER); the harness waits (FAULT_BOUND_S) for evidence
    that it fired: a rank's flight dump, /health naming the lockstep failure, or the worker's
    exit (not a /health that is merely late: a loaded box answers late);
  * tp-rank-kill: rank 1's process, its pid from colocated-0's /info, is SIGKILLed after a
    seeded delay (--kill-after).
Then, each a violation if not so:
  * the failure is detected and named within DETECT_BOUND_S of the fault: every watcher
    request in flight then ends with an error naming rank 1 and the step (the fault's time:
    the kill's, or the record rank 1 dumped for the step the ranks parted at), and none of
    them ends well after the leader failed (LATE_OK_S);
  * the TP worker fails cleanly: its /health is red (or it is gone) within DETECT_BOUND_S and
    never 200 again, it exits non-zero within EXIT_BOUND_S, and no rank outlives it (by pid);
    the flight recorders name the same step and rank (doctor/flight.py);
  * the cluster keeps serving: the chaos client's run (bounded: --duration, ended AFTER_S
    after the failure) finishes with every request ended within its deadline, the router
    takes colocated-0 out of rotation, and FRESH new requests succeed;
  * nothing leaks: colocated-1 and the router return to quiescence.
A pid is signalled only while it is still the process meant: a rank's command line names its
worker (`--parent PID`, `is_rank_of`), since a pid freed by a process that exited may be another
test's server by then.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

from pdserve.chaos import probes
from pdserve.chaos.cluster import Cluster, ClusterSpec, WorkerRef
from pdserve.chaos.kills import FRESH, GRACE_S
from pdserve.chaos.load import LoadProcess
from pdserve.chaos.scenarios import ChaosOptions, Context, Outcome
from pdserve.chaos.watcher import Watcher
from pdserve.doctor.diagnosis import Diagnosis
from pdserve.doctor.flight import add_flights, parting
from pdserve.parallel.flight_recorder import GROUP_PREFIX, Group, read_dir
from pdserve.runtime import httpcall
from pdserve.runtime.faults import first_firing
from pdserve.runtime.pids import cmdline, pid_alive, signal_pdserve, wait_gone

FAULTED, SURVIVOR = "colocated-0", "colocated-1"
VICTIM_RANK = 1
FIRE_P = 0.02  # tp-desync: the fault's chance on each of rank 1's forward records ...
FIRE_AFTER = (40, 120)  # ... placed, by its seed, on one of these (the n-th record)
DETECT_BOUND_S = 5.0  # the fault -> every request in flight on the TP worker failed, named
FAULT_BOUND_S = 20.0  # tp-desync: the fault fires (and the worker fails) within this much load
EXIT_BOUND_S = 15.0  # the failure -> the worker process exited
RANKS_GONE_S = 10.0  # the worker exited -> its ranks are gone
ROTATION_BOUND_S = 10.0  # the router checks each worker's /health every second
AFTER_S = 4.0  # the chaos client's load goes on this long past the failure (kill) or start
CLIENT_END_S = 20.0  # past its last request's bound: the chaos client has exited
LATE_OK_S = 0.5  # a request in flight at the fault that ends well this long after the leader
# failed was not failed with its group (its last token came before the failure, its answer late)
LOCKSTEP = "out of lockstep"  # the words of a lockstep failure on /health
WATCHERS = 2
NAMED = re.compile(rf"step (\d+): .*\brank {VICTIM_RANK}\b")


class TpFault:
    destructive = True
    needs_launch = True  # colocated-0's flags and (desync) its fault point

    def __init__(self, fault: str) -> None:
        self.fault = fault  # "desync" | "rank-kill"
        self.name = f"tp-{fault}"

    def spec(self, opts: ChaosOptions) -> ClusterSpec | None:
        return None  # a cluster of its own, started in run() with its flight directory

    def unfit(self, workers: list[WorkerRef]) -> str | None:
        return None

    def cluster_spec(self, ctx: Context, flight: Path) -> tuple[ClusterSpec, dict[str, Any]]:
        """colocated-0 at --tp 2 (and, desync, its fault point), colocated-1 at TP 1."""
        b = ctx.opts.base_spec()
        args = ("--tp", "2", "--flight-dir", str(flight), "--max-model-len", "1024")
        env: tuple[tuple[str, str, str], ...] = ()
        placed: dict[str, Any] = {}
        if self.fault == "desync":
            point = f"tp.recv.{VICTIM_RANK}"
            lo, hi = FIRE_AFTER
            seed = ctx.rng.randrange(2**31)
            while not lo <= (nth := first_firing(point, FIRE_P, seed, hi) or 0):
                seed += 1
            spec = f"{point}=malformed@{FIRE_P}#1"
            env = ((FAULTED, "PDSERVE_FAULTS", spec), (FAULTED, "PDSERVE_FAULT_SEED", str(seed)))
            placed = {"fault": spec, "seed": seed, "fires_on_record": nth}
        cluster = ClusterSpec(0, 2, b.backend, b.model, b.threads, worker_env=env,
                              worker_args=((FAULTED, args),))  # fmt: skip
        return cluster, placed

    def run(self, ctx: Context, out: Outcome) -> None:
        flight = ctx.work_dir / f"{self.name}-flight"
        spec, placed = self.cluster_spec(ctx, flight)
        rec: dict[str, Any] = {"fault": self.fault, **placed}
        out.rounds.append(rec)
        out.cluster = spec.describe()
        cluster = ctx.launch(spec)
        try:
            self.one_round(ctx, out, cluster, flight, rec)
        finally:
            cluster.close()
            worker = rec.get("worker_pid")
            stray = [  # reported, and ended: a chaos run leaves no process behind
                pid
                for pid in rec.get("rank_pids", [])
                if signal_pdserve(pid, signal.SIGKILL, lambda argv: is_rank_of(argv, worker))
            ]
            if stray:
                wait_gone(stray, RANKS_GONE_S)
                out.violate(f"rank processes {stray} outlived their cluster")
        out.summary = {
            "headline": (
                f"{self.fault} at step {rec.get('step')} (rank {rec.get('ranks')}): named "
                f"{rec.get('named_after_s')}s after the fault, worker exited "
                f"{rec.get('exit_code')} after {rec.get('exited_after_s')}s, "
                f"{FRESH - len(rec.get('fresh_failed') or [])}/{FRESH} new ok, "
                + ("survivor quiet" if rec.get("quiet_after_s") is not None else "NOT QUIET")
            ),
            **{k: v for k, v in rec.items() if k not in ("doctor", "client", "watchers")},
        }
        ctx.say(out.summary["headline"])

    def one_round(
        self, ctx: Context, out: Outcome, cluster: Cluster, flight: Path, rec: dict[str, Any]
    ) -> None:
        router, url = cluster.url, cluster.names[FAULTED]
        info = httpcall.get(url + "/info", 10.0).body or {}
        ranks = list((info.get("tp") or {}).get("pids") or [])
        rec.update(worker=url, worker_pid=info.get("pid"), rank_pids=ranks)
        if len(ranks) != 1 or not isinstance(info.get("pid"), int):
            out.violate(f"{url} is not a TP 2 worker with one follower rank: /info {info}")
            return
        stop = threading.Event()
        watchers = [Watcher(url, i, stop).start() for i in range(WATCHERS)]
        delay = round(ctx.rng.uniform(*ctx.opts.kill_after), 3)
        # Bounded either way: desync's is ended early, AFTER_S past the failure (load.stop).
        duration = delay + AFTER_S if self.fault == "rank-kill" else FAULT_BOUND_S + AFTER_S
        load = LoadProcess(router, ctx.opts.load(ctx.rng.randrange(2**31), duration),
                           ctx.work_dir / f"{self.name}.json").start()  # fmt: skip
        try:
            if not load.wait_loaded():
                out.violate(f"the chaos client never started its load: {load.log_tail()}")
                return
            fault_at = self.inject(ctx, out, rec, int(info["pid"]), ranks[0], flight, delay)
            stop.set()
            failed_at = time.monotonic()
            hung = [w.index for w in watchers if not w.join(DETECT_BOUND_S + 5.0)]
            if hung:
                out.violate(f"watcher requests {hung} still out {DETECT_BOUND_S + 5.0}s on")
            self.check_worker(ctx, out, cluster, rec, int(info["pid"]), ranks, failed_at)
            group = self.check_flight(out, rec, flight)
            fault_at = fault_at if fault_at is not None else rec.get("fault_unix")
            self.check_named(out, rec, watchers, fault_at)
            if self.fault == "desync":  # the load ran until the fault: AFTER_S more, then end
                time.sleep(max(0.0, AFTER_S - (time.monotonic() - failed_at)))
                load.stop()  # as its --duration would: every request in flight ends first
            rec["client_exit"] = load.wait_exit(AFTER_S + ctx.opts.request_timeout_s + CLIENT_END_S)
        finally:
            stop.set()
            load.kill()
        self.check_load(ctx, out, rec, load.progress())
        self.check_serving(ctx, out, cluster, rec, url)
        rec["doctor"] = doctor_lines(flight, group)
        if not out.ok:
            out.diagnosis = ctx.diagnose(cluster) + rec["doctor"]

    def inject(
        self,
        ctx: Context,
        out: Outcome,
        rec: dict[str, Any],
        worker: int,
        rank: int,
        flight: Path,
        delay: float,
    ) -> float | None:
        """Make the ranks part: a kill after `delay`, returning at once with its wall-clock
        time; a desync (placed by the seed) once there is evidence that it fired (`fired`),
        with None: the flight recorder tells when it was."""
        url = rec["worker"]
        t0 = time.monotonic()
        if self.fault == "rank-kill":
            time.sleep(delay)
            at = time.time()
            if not signal_pdserve(rank, signal.SIGKILL, lambda argv: is_rank_of(argv, worker)):
                out.violate(
                    f"rank {VICTIM_RANK} (pid {rank}) was gone before the kill (or not that rank)"
                )
            ctx.say(f"SIGKILLed rank {VICTIM_RANK} (pid {rank}) of {url} after {delay}s of load")
            rec["kill_after_s"] = delay
            return at
        while (seen := fired(url, worker, flight)) is None:
            if time.monotonic() - t0 > FAULT_BOUND_S:
                out.violate(f"tp.recv.{VICTIM_RANK}=malformed did not fire in {FAULT_BOUND_S}s")
                return None
            time.sleep(0.05)
        rec["fired_seen"] = seen
        ctx.say(f"{url} failed after {time.monotonic() - t0:.1f}s of load ({seen})")
        return None

    def check_worker(
        self,
        ctx: Context,
        out: Outcome,
        cluster: Cluster,
        rec: dict[str, Any],
        pid: int,
        ranks: list[int],
        since: float,
    ) -> None:
        """Its /health turns red (or it is gone) within DETECT_BOUND_S and stays so; it exits
        non-zero within EXIT_BOUND_S; its ranks are gone."""
        red = False
        while pid_alive(pid):
            up = httpcall.get(rec["worker"] + "/health", 2.0).ok
            if red and up:
                out.violate(f"{rec['worker']} answered /health 200 again after its ranks failed")
                return
            red = red or not up
            waited = time.monotonic() - since
            if not red and waited > DETECT_BOUND_S:
                out.violate(f"{rec['worker']}: /health 200 {DETECT_BOUND_S}s after the failure")
                return
            if waited > EXIT_BOUND_S:
                out.violate(f"{rec['worker']} still runs {EXIT_BOUND_S}s after its ranks failed")
                return
            time.sleep(0.05)
        rec["exited_after_s"] = round(time.monotonic() - since, 3)
        code = rec["exit_code"] = wait_code(cluster, pid)
        if code in (None, 0):
            out.violate(f"{rec['worker']} exited with {code} after its ranks failed (not 1)")
        # Only a process that is still the rank (a pid freed may be someone else's by now).
        left = [p for p in wait_gone(ranks, RANKS_GONE_S) if is_rank_of(cmdline(p), pid)]
        rec["ranks_left"] = left
        if left:
            out.violate(f"rank processes {left} outlived their worker by {RANKS_GONE_S}s")

    def check_flight(self, out: Outcome, rec: dict[str, Any], flight: Path) -> Group | None:
        """The ranks' dumps name where they parted: rank 1, at one step."""
        groups = read_dir(flight)
        if len(groups) != 1:
            out.violate(f"{flight}: {len(groups)} groups of flight recorders, not 1")
            return None
        group = groups[0]
        p = parting(group.dumps)
        rec["dumped_ranks"] = [d.rank for d in group.dumps]
        if p is None:
            out.violate(f"{group.directory}: no dump to read")
            return group
        rec.update(step=p.step, ranks=list(p.ranks), parted=p.how)
        if p.ranks != (VICTIM_RANK,):
            out.violate(f"the flight recorders blame ranks {p.ranks}, not {VICTIM_RANK}: {p.how}")
        if self.fault == "desync":  # rank 1's record of the step it read otherwise: the fault
            mine = next((d for d in group.dumps if d.rank == VICTIM_RANK), None)
            hit = next((f for f in mine.flights if f.step == p.step), None) if mine else None
            if mine is None or hit is None:
                out.violate(f"rank {VICTIM_RANK} dumped no record of step {p.step}")
            else:
                rec["fault_unix"] = mine.unix(hit)
        leader = next((d for d in group.dumps if d.rank == 0), None)
        if leader is not None:
            rec["leader_failed_unix"] = leader.failed_unix
        return group

    def check_named(
        self, out: Outcome, rec: dict[str, Any], watchers: list[Watcher], fault_at: float | None
    ) -> None:
        """Every watcher request out at the fault failed within the bound, naming rank 1 and
        the step the flight recorders name; none ended well after the leader failed."""
        if fault_at is None:
            out.violate("no time for the fault: cannot tell how soon it was named")
            return
        rec["watchers"] = [[a.__dict__ for a in w.asks] for w in watchers]
        failed = rec.get("leader_failed_unix", fault_at)  # no leader's dump: the fault's time
        late = [a for w in watchers for a in w.asks
                if a.started < fault_at and a.ok and a.ended > failed + LATE_OK_S]  # fmt: skip
        for a in late:
            out.violate(f"a request in flight at the fault ended well {a.ended - failed:.2f}s "
                        f"after the leader failed (bound {LATE_OK_S}s)")  # fmt: skip
        hit = [a for w in watchers for a in w.asks if a.started < fault_at and not a.ok]
        if not hit:
            out.violate("no watcher request was in flight on the TP worker at the fault")
            return
        if "leader_failed_unix" in rec:
            rec["detected_after_s"] = round(rec["leader_failed_unix"] - fault_at, 3)
        rec["named_after_s"] = round(max(a.ended for a in hit) - fault_at, 3)
        for a in hit:
            m = NAMED.search(a.error)
            if m is None or int(m.group(1)) != rec.get("step"):
                out.violate(f"a request failed without naming rank {VICTIM_RANK} and step "
                            f"{rec.get('step')}: {a.error}")  # fmt: skip
            if a.ended - fault_at > DETECT_BOUND_S:
                out.violate(f"a request in flight failed {a.ended - fault_at:.1f}s after the "
                            f"fault (bound {DETECT_BOUND_S}s)")  # fmt: skip

    def check_load(
        self, ctx: Context, out: Outcome, rec: dict[str, Any], client: dict[str, Any]
    ) -> None:
        rec["client"] = client
        bound = ctx.opts.request_timeout_s + GRACE_S
        if client.get("errors", {}).get("hung"):
            out.violate(f"{client['errors']['hung']} chaos-client requests hung")
        if not client.get("finished"):
            out.violate("the chaos client did not finish its run: some request never ended")
        if client.get("max_request_s", 0.0) > bound:
            out.violate(f"a request took {client['max_request_s']:.1f}s (bound {bound:.0f}s)")

    def check_serving(
        self, ctx: Context, out: Outcome, cluster: Cluster, rec: dict[str, Any], url: str
    ) -> None:
        """The router routes around the dead worker; the survivor serves and goes quiet."""
        t0 = time.monotonic()
        while any(w.url == url and w.healthy for w in cluster.workers()):
            if time.monotonic() - t0 > ROTATION_BOUND_S:
                out.violate(f"the router still calls {url} healthy after {ROTATION_BOUND_S}s")
                break
            time.sleep(0.1)
        fails = [f for f in (probes.fresh_completion(cluster.url) for _ in range(FRESH)) if f]
        rec["fresh_failed"] = fails
        if fails:
            out.violate(f"{len(fails)} of {FRESH} new requests failed: {fails[0]}")
        quiet = probes.wait_quiet(cluster.url, [cluster.names[SURVIVOR]], ctx.opts.quiet_bound_s)
        rec["quiet_after_s"] = quiet.after_s if quiet.ok else None
        rec["leaked_pages"] = quiet.leaked_pages
        if not quiet.ok:
            out.violate(f"not quiet after {ctx.opts.quiet_bound_s:.0f}s: {quiet.violations}")


def fired(url: str, worker: int, flight: Path) -> str | None:
    """What shows that the ranks parted, if anything does yet: a rank's dump in the flight
    directory, the worker's /health naming the lockstep failure, or the worker gone. A /health
    that is late or not 200 for another reason is no evidence: the load may just slow it."""
    if any(flight.glob(f"{GROUP_PREFIX}*/rank-*.json")):
        return "a rank's flight dump"
    r = httpcall.get(url + "/health", 2.0)
    if not r.ok and LOCKSTEP in str(r.body):
        return f"/health {r.status} naming it"
    if not pid_alive(worker):
        return "the worker exited"
    return None


def is_rank_of(argv: list[str], worker: int | None) -> bool:
    """True if `argv` is a tensor-parallel rank's that `worker` started (tp_leader.py's
    follower command line: `-m pdserve.engine.tp_follower ... --parent PID`)."""
    if "pdserve.engine.tp_follower" not in argv or "--parent" not in argv[:-1]:
        return False
    return argv[argv.index("--parent") + 1] == str(worker)


def wait_code(cluster: Cluster, pid: int, bound_s: float = 5.0) -> int | None:
    t0 = time.monotonic()
    while (code := cluster.exit_code(pid)) is None and time.monotonic() - t0 < bound_s:
        time.sleep(0.05)
    return code


def doctor_lines(flight: Path, group: Group | None) -> list[str]:
    """What `pdserve doctor --flight` says of the flight directory."""
    d = Diagnosis(header=f"flight recorders under {flight}")
    add_flights(d, flight, [group] if group is not None else [])
    return d.lines()
