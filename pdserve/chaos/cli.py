"""`pdserve chaos`: run fault scenarios against a live cluster and check it recovers.

    pdserve chaos [--scenario NAME ...|all] [--rounds N] [--url ROUTER] [--report FILE]

Without --url, chaos launches the cluster each scenario needs (`pdserve launch` as a
child, stopped by pid at the end, whatever happens) and reuses it while the next scenario
wants the same one and the previous did not kill part of it. With --url it only speaks
HTTP to that router, with the key of $PDSERVE_CLUSTER_KEY_FILE or else the one `pdserve
launch` left for this user at that address (runtime/local_keys.py); a scenario that kills a
worker reads its pid from /debug/cluster and needs the cluster to run on this machine.

Progress goes to stderr, one line per phase or round; the summary to stdout; the whole
record to --report as JSON. Exit code: 0 every scenario that ran passed, 1 a violation,
2 chaos could not run (the cluster did not start, or no scenario could run).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from pdserve.chaos.cluster import (
    AttachedCluster,
    Cluster,
    ClusterError,
    ClusterSpec,
    LaunchedCluster,
)
from pdserve.chaos.composed import ComposedCluster
from pdserve.chaos.disconnects import ClientDisconnect
from pdserve.chaos.faulted import DROPPABLE, MessageFaults, ThreadCrash
from pdserve.chaos.fuzz import Fuzz
from pdserve.chaos.kills import WorkerKill
from pdserve.chaos.resets import EarlyReset
from pdserve.chaos.scenarios import ChaosOptions, Context, Outcome, Scenario, scenario_rng
from pdserve.chaos.stops import PrefillStop
from pdserve.chaos.storm import AbortStorm
from pdserve.chaos.threadkill import ThreadKill
from pdserve.chaos.tp import TpFault
from pdserve.config import BACKENDS
from pdserve.runtime import httpcall

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        AbortStorm(),
        ClientDisconnect(),
        EarlyReset(),
        WorkerKill("prefill"),
        PrefillStop(),
        WorkerKill("decode"),
        ThreadCrash(),
        ThreadKill(),
        MessageFaults(),
        Fuzz(),
        TpFault("desync"),
        TpFault("rank-kill"),
    )
}


def kill_range(text: str) -> tuple[float, float]:
    lo, sep, hi = text.partition(":")
    try:
        return (float(lo), float(hi if sep else lo))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX seconds, got {text!r}") from e


def add_chaos_command(sub: Any) -> None:
    """Register `chaos` on the subparsers object of `pdserve`'s top-level parser."""
    d = ChaosOptions()
    p: argparse.ArgumentParser = sub.add_parser(
        "chaos",
        help="run fault scenarios (abort storm, ...) and check the cluster recovers",
        description="Run fault scenarios against a cluster under load and check that it "
        "recovers: no hang, no leak, every invariant holds afterwards. Without --url each "
        "scenario launches the cluster it needs on this machine.\n\n"
        "exit status: 0 every scenario that ran passed; 1 a violation; 2 chaos could not "
        "run (the cluster did not start, or no scenario could run).",
    )
    p.add_argument(
        "--scenario",
        action="append",
        metavar="NAME",
        help=f"{', '.join(SCENARIOS)} or all; repeatable (default: abort-storm)",
    )
    p.add_argument("--url", default=None, help="a running router (default: launch a cluster)")
    p.add_argument("--rounds", type=int, default=d.rounds, help="rounds of each scenario")
    p.add_argument("--seed", type=int, default=d.seed, help="of the load, the kills and the fuzz")
    p.add_argument("--sessions", type=int, default=d.sessions, help="concurrent chat sessions")
    p.add_argument(
        "--kill-after",
        type=kill_range,
        default=d.kill_after,
        metavar="MIN:MAX",
        help="seconds of load before the kill, drawn per round (default 2:25)",
    )
    p.add_argument(
        "--prefill", type=int, default=d.prefill, help="prefill workers of a launched cluster"
    )
    p.add_argument(
        "--decode", type=int, default=d.decode, help="decode workers of a launched cluster"
    )
    p.add_argument(
        "--backend", default=d.backend, choices=BACKENDS, help="KV data plane of a launched cluster"
    )
    p.add_argument("--model", default=d.model, help="model of a launched cluster")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per worker")
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch every worker with --engine-process or --no-engine-process (its engine in "
        "a process of its own or not; default: serve's, on for CUDA)",
    )
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="per chat turn")
    p.add_argument("--abandon", type=float, default=d.abandon, help="chance to drop a stream")
    p.add_argument(
        "--min-throughput-ratio",
        type=float,
        default=d.min_throughput_ratio,
        help="abort-storm: least tokens/s of the last round over the first",
    )
    p.add_argument(
        "--steady-s",
        type=float,
        default=d.steady_s,
        help="abort-storm: seconds of steady load when fresh and after the storm (0: off)",
    )
    p.add_argument(
        "--messages",
        default=",".join(d.messages),
        help="message-faults: the control messages to drop in turn, comma-separated",
    )
    p.add_argument(
        "--requests", type=int, default=d.requests, help="fuzz: how many seeded cases to send"
    )
    p.add_argument(
        "--resets", type=int, default=d.resets, help="early-reset: connections reset per storm"
    )
    p.add_argument(
        "--reset-bound-s",
        type=float,
        default=d.reset_bound_s,
        help="early-reset: seconds from the storm's end until every worker must be quiet",
    )
    p.add_argument(
        "--fresh-bound-s",
        type=float,
        default=d.fresh_bound_s,
        help="early-reset: seconds a fresh request after the storm may take",
    )
    p.add_argument(
        "--report", default=None, help="write the JSON report here (default: summary only)"
    )
    p.add_argument("--work-dir", default=None, help="logs and progress files (default: temp)")
    p.set_defaults(func=cmd_chaos)


def cmd_chaos(args: argparse.Namespace) -> int:
    names = args.scenario or ["abort-storm"]
    if "all" in names:
        names = list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario {unknown}; known: {', '.join(SCENARIOS)} or all")
    messages = tuple(m.strip() for m in args.messages.split(",") if m.strip())
    if set(messages) - set(DROPPABLE):
        raise ValueError(
            f"--messages: unknown {sorted(set(messages) - set(DROPPABLE))}; "
            f"known: {', '.join(DROPPABLE)}"
        )
    opts = ChaosOptions(
        rounds=args.rounds,
        seed=args.seed,
        sessions=args.sessions,
        kill_after=args.kill_after,
        prefill=args.prefill,
        decode=args.decode,
        backend=args.backend,
        model=args.model,
        threads=args.threads,
        engine_process=args.engine_process,
        max_tokens=args.max_tokens,
        abandon=args.abandon,
        min_throughput_ratio=args.min_throughput_ratio,
        steady_s=args.steady_s,
        messages=messages,
        requests=args.requests,
        resets=args.resets,
        reset_bound_s=args.reset_bound_s,
        fresh_bound_s=args.fresh_bound_s,
    )
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="pdserve-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    say("chaos", f"work directory {work}")
    if args.url and args.engine_process is not None:
        say("chaos", "--[no-]engine-process is for clusters chaos launches; --url's is as it is")
    if args.url:  # $PDSERVE_CLUSTER_KEY_FILE's key, else the one launch left for --url
        refused = httpcall.use_key_for(args.url)
        say("chaos", refused or f"key: {httpcall.key_origin()}")
    previous = signal.signal(signal.SIGTERM, _terminate)  # so `finally` stops our children
    t0 = time.monotonic()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    try:
        outcomes = run_scenarios(opts, names, args.url, work)
    finally:
        signal.signal(signal.SIGTERM, previous)
    ran = [o for o in outcomes if o.skipped is None]
    cannot = not ran or any(o.summary.get("cluster_failed") for o in outcomes)
    code = 1 if any(not o.ok for o in outcomes) else (2 if cannot else 0)
    report = {
        "tool": "pdserve chaos",
        "ok": code == 0,
        "exit_code": code,
        "started_at": started,
        "duration_s": round(time.monotonic() - t0, 3),
        "url": args.url,
        "options": {**asdict(opts), "scenarios": names},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "violations": sum(len(o.violations) for o in outcomes),
        "scenarios": [o.to_json() for o in outcomes],
        "work_dir": str(work),
    }
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1))
    print(render_summary(outcomes, code, args.report))
    return code


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def say(scope: str, message: str) -> None:
    print(f"chaos[{scope}] {message}", file=sys.stderr, flush=True)


def run_scenarios(
    opts: ChaosOptions, names: list[str], url: str | None, work: Path
) -> list[Outcome]:
    runner = Runner(opts, url, work)
    try:
        return [runner.run(name) for name in names]
    finally:
        runner.drop(functools.partial(say, "chaos"))


class Runner:
    """Runs scenarios one after another, each on a cluster that fits it."""

    def __init__(self, opts: ChaosOptions, url: str | None, work: Path) -> None:
        self.opts, self.url, self.work = opts, url, work
        self.current: Cluster | None = None
        self.current_spec: ClusterSpec | None = None
        self.reusable = False  # the current cluster is intact: no scenario hurt it
        self.launches = 0

    def run(self, name: str) -> Outcome:
        sc = SCENARIOS[name]
        out = Outcome(name)
        t0 = time.monotonic()
        progress = functools.partial(say, name)
        try:
            if self.url is not None and sc.needs_launch:
                out.skipped = "its faults go into a cluster's environment: needs chaos to launch"
            else:
                cluster = self.shared(sc, progress)
                out.cluster = (
                    f"attached {self.url}"
                    if self.url
                    else (self.current_spec.describe() if self.current_spec else "its own clusters")
                )
                why = (
                    None
                    if cluster is None
                    else sc.unfit([w for w in cluster.workers() if w.healthy])
                )
                if why is not None:
                    out.skipped = why
                else:
                    rng = scenario_rng(self.opts.seed, name)
                    launch = functools.partial(self.launch, say=progress)
                    sc.run(Context(self.opts, cluster, self.work, rng, progress, launch), out)
                    self.reusable = not sc.destructive
        except ClusterError as e:
            out.violate(f"cluster: {e}")
            out.summary["cluster_failed"] = True
            self.reusable = False
        except Exception as e:  # noqa: BLE001 - a harness bug fails this scenario, not the run
            out.violate(f"chaos itself failed: {e!r}")
            out.summary["traceback"] = traceback.format_exc()
            self.reusable = False
        if out.skipped:
            progress(f"skipped: {out.skipped}")
        out.duration_s = time.monotonic() - t0
        progress(("PASS" if out.ok else "FAIL") + f" in {out.duration_s:.1f}s")
        return out

    def shared(self, sc: Scenario, progress: Callable[[str], None]) -> Cluster | None:
        if self.url is not None:
            self.current = self.current or AttachedCluster(self.url)
            return self.current
        spec = sc.spec(self.opts)
        if spec is not None:  # as launched, so the report names it whole
            spec = replace(spec, engine_process=self.opts.engine_process)
        if self.current is not None and self.reusable and spec == self.current_spec:
            return self.current
        self.drop(progress)
        if spec is not None:
            self.current, self.current_spec = self.launch(spec, progress), spec
        return self.current

    def launch(self, spec: ClusterSpec, say: Callable[[str], None]) -> Cluster:
        """Start a cluster for `spec`; whoever asked for it closes it."""
        self.launches += 1
        t0 = time.monotonic()
        spec = replace(spec, engine_process=self.opts.engine_process)
        say(f"launching {spec.describe()}")
        log_dir = self.work / f"cluster-{self.launches}"
        cluster: Cluster
        if spec.worker_env or spec.worker_args:
            cluster = ComposedCluster(spec, log_dir).start()
        else:
            cluster = LaunchedCluster(spec, log_dir).start()
        workers = cluster.workers()  # the engine processes as the workers resolved them
        engines = sum(w.engine_pid is not None for w in workers)
        say(
            f"cluster up at {cluster.url} ({time.monotonic() - t0:.1f}s; "
            f"{engines} of {len(workers)} workers with an engine process)"
        )
        return cluster

    def drop(self, progress: Callable[[str], None]) -> None:
        """Stop the current cluster if we started it."""
        if self.current is not None and self.current.launched:
            progress("stopping the cluster")
            self.current.close()
        self.current, self.current_spec, self.reusable = None, None, False


def render_summary(outcomes: list[Outcome], code: int, report: str | None) -> str:
    lines = []
    for o in outcomes:
        status = "SKIP" if o.skipped else ("PASS" if o.ok else "FAIL")
        lines.append(f"{o.name:<16} {status}  {o.summary.get('headline') or o.skipped or ''}")
        lines += [f"    - {v}" for v in o.violations[:20]]
        if len(o.violations) > 20:
            lines.append(f"    - ... and {len(o.violations) - 20} more (see the report)")
        lines += [f"    doctor: {d}" for d in o.diagnosis[:15]]
    verdict = {0: "PASS", 1: "FAIL", 2: "COULD NOT RUN"}[code]
    total = sum(len(o.violations) for o in outcomes)
    lines.append(
        f"verdict: {verdict} ({total} violations)" + (f"; report {report}" if report else "")
    )
    return "\n".join(lines)
