"""The launcher: a whole cluster on this machine — N prefill + M decode workers + a router.

Startup: start every worker on port 0, wait for all their READY lines (the barrier, bounded
by the startup timeout), then start the router over their URLs and wait for its READY.
Print the process table and `READY <router url>` last, so whoever reads our stdout has the
table once it sees READY; the same table goes to LOG_DIR/cluster.json.
GPUs: with `gpus` the workers are spread over those GPUs round-robin in start order (prefill
workers first), each seeing only its own through CUDA_VISIBLE_DEVICES, so 1P+1D on a two-GPU
host puts each on its own GPU (as SGLang's --base-gpu-id and vLLM/Dynamo's per-worker
CUDA_VISIBLE_DEVICES do); without, every worker sees what the launcher sees. With `mps`, the
cluster's own MPS daemon starts first and stops last (runtime/mps.py), and every worker is its
client: workers sharing a GPU run their kernels side by side.
Once the router is up, the cluster key is also left for this user at the router's address
(runtime/local_keys.py), so `pdserve doctor --url URL` needs no flag; it is removed once the
cluster has stopped.
Run: sleep until a stop signal or a child's exit wakes us (SIGCHLD), with a bounded wait.
Stop: the router first (no new request reaches a worker that is going away), then the
workers: SIGTERM, a bounded wait, SIGKILL. Any failure stops what was started and exits
non-zero, naming the child and quoting its log. Children die with us even on SIGKILL
(see runtime/child.py). Signal handlers are process-wide: run one Launcher per process,
from the main thread.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pdserve.runtime import local_keys
from pdserve.runtime.child import Child, ChildFailed
from pdserve.runtime.cluster_key import ClusterKey, ClusterKeyError
from pdserve.runtime.mps import MpsDaemon
from pdserve.runtime.ready import announce_ready
from pdserve.runtime.timing import LAUNCH_POLL_S, LAUNCH_WAKE_S

log = logging.getLogger(__name__)

WORKER_HOST = "127.0.0.1"  # only the router talks to the workers, from this machine


@dataclass(frozen=True)
class LaunchConfig:
    model_path: str  # resolved once here; every child gets the same directory
    served_model_name: str
    prefill: int
    decode: int
    threads: int  # torch threads per worker, resolved from the CPU count when not given
    engine_flags: tuple[str, ...]  # the `serve` engine flags to pass on, --model excluded
    log_dir: Path
    cluster_key_file: str  # the secret every process of the cluster shares (0600)
    api_key_file: str | None = None  # the router's clients' key (0600), if any
    protect_health: bool = False  # the router's /health and /metrics need a key too
    reject_unknown_fields: bool = False  # the router answers 400 to an unknown request field
    tool_call_parser: str = "auto"  # the router's --tool-call-parser
    trust_request_chat_template: bool = False  # the router renders a request's own template
    prefix_index_pages: int | None = None  # --policy prefix's settings (None: the router's)
    prefix_max_imbalance: int | None = None
    max_queue: int = 4096  # the router's completion calls in flight at most
    host: str = "127.0.0.1"
    port: int = 8000
    router_processes: int = 1  # the router's --processes (router/pool.py)
    backend: str = "shm"
    debug_faults: bool = False  # workers take POST /debug/faults
    policy: str = "least-outstanding"
    worker_streams: str = "shared"  # the router's --worker-streams
    log_level: str = "INFO"
    request_timeout_s: float = 600.0
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 30.0  # per phase (router, workers) before SIGKILL
    on_worker_exit: str = "stop"  # stop | continue (the router routes around a dead worker)
    prefill_threads: int = 0  # per-role overrides of `threads` (0: use `threads`)
    decode_threads: int = 0
    gpus: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES entries to spread the workers over
    # The share of each card the workers on it hold together (serve's --gpu-memory-utilization,
    # divided among the workers that share the card).
    gpu_memory_utilization: float = 0.9
    # Tensor-parallel ranks per prefill and per decode (or co-located) worker (0: the engine
    # flags' --tp), and where a worker at TP > 1 dumps its ranks' flight recorders.
    prefill_tp: int = 0
    decode_tp: int = 0
    flight_dir: str | None = None
    mps: bool = False  # the workers run under the cluster's own MPS daemon (runtime/mps.py)

    def threads_for(self, role: str) -> int:
        per_role = self.prefill_threads if role == "prefill" else self.decode_threads
        return per_role or self.threads

    def tp_for(self, role: str) -> int:
        """A `role` worker's --tp (0: the engine flags')."""
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(
                f"need --prefill >= 0 and --decode >= 1, got {self.prefill}, {self.decode}"
            )
        if min(self.threads, self.threads_for("prefill"), self.threads_for("decode")) < 1 or (
            self.startup_timeout_s <= 0 or self.stop_timeout_s <= 0
        ):
            raise ValueError(f"threads and timeouts must be positive: {self}")
        if self.on_worker_exit not in ("stop", "continue"):
            raise ValueError(f"on_worker_exit must be stop or continue, got {self.on_worker_exit}")


def _flags(opts: dict[str, str]) -> list[str]:
    return [x for kv in opts.items() for x in kv]


def worker_argvs(cfg: LaunchConfig) -> list[tuple[str, list[str]]]:
    """(name, argv) of every worker; co-located workers when there is no prefill pool."""
    base = [sys.executable, "-m", "pdserve", "--log-level", cfg.log_level, "serve"]
    common = _flags(
        {
            "--host": WORKER_HOST,
            "--port": "0",
            "--backend": cfg.backend,
            "--model": cfg.model_path,
            "--served-model-name": cfg.served_model_name,
            "--cluster-key-file": cfg.cluster_key_file,
        }
    )
    gpus = worker_gpus(cfg)
    out = []
    for role, i in _roles(cfg):
        name = f"{role}-{i}"
        extra = ["--control-port", "0"] if role == "prefill" else []
        extra += ["--debug-faults"] if cfg.debug_faults else []
        # Last, so that it wins over the engine flags' own: this worker's share of its card.
        sharing = sum(g == gpus[name] for g in gpus.values()) if gpus else cfg.prefill + cfg.decode
        share = round(cfg.gpu_memory_utilization / sharing, 4)
        extra += ["--gpu-memory-utilization", str(share)]
        tp = cfg.tp_for(role)
        extra += ["--tp", str(tp)] if tp else []
        extra += ["--flight-dir", cfg.flight_dir] if cfg.flight_dir and tp > 1 else []
        threads = ["--threads", str(cfg.threads_for(role))]
        argv = [*base, "--role", role, *threads, *common, *cfg.engine_flags, *extra]
        out.append((name, argv))
    return out


def _roles(cfg: LaunchConfig) -> list[tuple[str, int]]:
    """(role, index) of every worker in start order, prefill workers first."""
    roles = [("prefill", i) for i in range(cfg.prefill)]
    return roles + [("decode" if cfg.prefill else "colocated", i) for i in range(cfg.decode)]


def worker_gpus(cfg: LaunchConfig) -> dict[str, str]:
    """Each worker's GPU (a CUDA_VISIBLE_DEVICES entry): round-robin over `cfg.gpus` in start
    order, prefill workers first; none without `cfg.gpus` (each then sees every card the
    launcher sees, and the workers share the first)."""
    if not cfg.gpus:
        return {}
    names = [f"{role}-{i}" for role, i in _roles(cfg)]
    return {name: cfg.gpus[i % len(cfg.gpus)] for i, name in enumerate(names)}


def router_argv(cfg: LaunchConfig, prefill_urls: list[str], decode_urls: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "pdserve", "--log-level", cfg.log_level, "router"]
    argv += ["--decode", *decode_urls]
    if prefill_urls:
        argv += ["--prefill", *prefill_urls]
    return (
        argv
        + _flags(
            {
                "--host": cfg.host,
                "--port": str(cfg.port),
                "--processes": str(cfg.router_processes),
                "--policy": cfg.policy,
                "--worker-streams": cfg.worker_streams,
                **(
                    {"--prefix-index-pages": str(cfg.prefix_index_pages)}
                    if cfg.prefix_index_pages is not None
                    else {}
                ),
                **(
                    {"--prefix-max-imbalance": str(cfg.prefix_max_imbalance)}
                    if cfg.prefix_max_imbalance is not None
                    else {}
                ),
                "--model": cfg.model_path,
                "--served-model-name": cfg.served_model_name,
                "--request-timeout": str(cfg.request_timeout_s),
                "--startup-timeout": str(cfg.startup_timeout_s),
                "--cluster-key-file": cfg.cluster_key_file,
                **({"--api-key-file": cfg.api_key_file} if cfg.api_key_file else {}),
                "--max-queue": str(cfg.max_queue),
                "--tool-call-parser": cfg.tool_call_parser,
            }
        )
        + (["--protect-health"] if cfg.protect_health else [])
        + (["--reject-unknown-fields"] if cfg.reject_unknown_fields else [])
        + (["--trust-request-chat-template"] if cfg.trust_request_chat_template else [])
    )


class Launcher:
    def __init__(self, cfg: LaunchConfig, out: TextIO = sys.stdout) -> None:
        self.cfg = cfg
        self.out = out
        self.workers: list[Child] = []
        self.router: Child | None = None
        self._signal: int | None = None
        self._wake = threading.Event()  # set by SIGINT/SIGTERM/SIGCHLD handlers
        self._local_key: tuple[Path, ClusterKey] | None = None  # left for this user's tools
        self.mps = MpsDaemon(cfg.log_dir) if cfg.mps else None

    @property
    def children(self) -> list[Child]:
        return ([self.router] if self.router else []) + self.workers

    def run(self) -> int:
        """Start, serve until told to stop or a child dies, stop everything; the exit code."""
        previous = {
            s: signal.signal(s, self._on_signal)
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)
        }
        try:
            try:
                self._start()
            except ChildFailed as e:
                log.error("pdserve launch: startup failed: %s", e)
                if e.child is not None:
                    log.error("last lines of %s:\n%s", e.child.log_path, e.child.log_tail())
                return 1
            code = self._supervise()
        finally:
            stuck = self._stop_all()
            if self._local_key is not None:
                local_keys.withdraw(*self._local_key)
            for s, handler in previous.items():
                signal.signal(s, handler)
        return 1 if stuck else code

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum != signal.SIGCHLD and self._signal is None:
            self._signal = signum
        self._wake.set()

    def _start(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        gpus = worker_gpus(self.cfg)
        shared = self.mps.start(self.cfg.startup_timeout_s) if self.mps is not None else {}
        for name, argv in worker_argvs(self.cfg):
            env = {"CUDA_VISIBLE_DEVICES": gpus[name]} if name in gpus else {}
            self.workers.append(self._spawn(name, argv, {**shared, **env}))
        self._barrier(self.workers, deadline)
        urls = {c.name: str(c.url) for c in self.workers}
        self.router = self._spawn(
            "router",
            router_argv(
                self.cfg,
                [u for n, u in urls.items() if n.startswith("prefill")],
                [u for n, u in urls.items() if not n.startswith("prefill")],
            ),
        )
        self._barrier([self.router], deadline)
        self._leave_key(str(self.router.url))
        self._announce(self.router)

    def _leave_key(self, url: str) -> None:
        """Leave the cluster key for this user's tools at the router's address; a cluster
        that cannot is still a cluster (the tools then need the key named)."""
        try:
            key = ClusterKey.load(self.cfg.cluster_key_file)
            self._local_key = (local_keys.publish(url, key), key)
        except (OSError, ClusterKeyError) as e:
            log.warning("the tools will need --cluster-key-file: no local key for %s: %s", url, e)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        child = Child(name, argv, self.cfg.log_dir / f"{name}.log", env)
        child.start()  # from the main thread: PDEATHSIG is tied to the forking thread
        gpu = (env or {}).get("CUDA_VISIBLE_DEVICES")
        on = f" on GPU {gpu}" if gpu else ""
        log.info("started %s (pid %d)%s", name, child.pid, on)
        return child

    def _barrier(self, children: list[Child], deadline: float) -> None:
        while not all([c.check_ready() for c in children]):  # list: check every child
            if self._signal is not None:
                raise ChildFailed(f"interrupted by signal {self._signal} during startup")
            if time.monotonic() > deadline:
                late = [c for c in children if c.url is None]
                raise ChildFailed(
                    f"{', '.join(f'{c.name} (pid {c.pid})' for c in late)} printed no READY "
                    f"line within --startup-timeout {self.cfg.startup_timeout_s:.0f}s",
                    late[0],
                )
            time.sleep(LAUNCH_POLL_S)

    def _announce(self, router: Child) -> None:
        rows = [
            (c.name, c.pid, c.url, str(c.log_path), c.env.get("CUDA_VISIBLE_DEVICES"))
            for c in [*self.workers, router]
        ]
        table = self.cfg.log_dir / "cluster.json"
        table.write_text(
            json.dumps(
                {
                    "url": router.url,
                    "launcher_pid": os.getpid(),
                    "cluster_key_file": self.cfg.cluster_key_file,
                    "local_key_file": str(self._local_key[0]) if self._local_key else None,
                    "processes": [
                        dict(zip(("name", "pid", "url", "log", "gpu"), r, strict=True))
                        for r in rows
                    ],
                },
                indent=1,
            )
        )
        print(f"pdserve launch: cluster up ({table})", file=self.out)
        print(f"  {'NAME':<12} {'PID':>8}  {'URL':<26} {'GPU':<4} LOG", file=self.out)
        for name, pid, url, path, gpu in rows:
            print(f"  {name:<12} {pid:>8}  {url:<26} {gpu or '-':<4} {path}", file=self.out)
        if self._local_key is not None:
            print(
                f"pdserve launch: `pdserve doctor --url {router.url}` finds the cluster key "
                f"in {self._local_key[0]} (removed on stop)",
                file=self.out,
            )
        announce_ready(str(router.url), self.out)

    def _supervise(self) -> int:
        reported: set[str] = set()
        while True:
            self._wake.clear()  # before looking, so a wake-up during the look is not lost
            if self._signal is not None:
                log.info("signal %d: stopping the cluster", self._signal)
                return 0
            for c in self.children:
                code = c.poll()
                if code is None or c.name in reported:
                    continue
                reported.add(c.name)
                log.error(
                    "!!! %s (pid %d) exited unexpectedly with code %d; last lines of %s:\n%s",
                    c.name,
                    c.pid,
                    code,
                    c.log_path,
                    c.log_tail(),
                )
                if c is self.router or self.cfg.on_worker_exit == "stop":
                    log.error("!!! stopping the cluster because %s died", c.name)
                    return 1
            if all(c.poll() is not None for c in self.workers):
                log.error("!!! every worker has exited; stopping the cluster")
                return 1
            self._wake.wait(LAUNCH_WAKE_S)

    def _stop_all(self) -> bool:
        """Router first, then every worker; True if some child needed SIGKILL."""
        stuck = False
        for group in ([self.router] if self.router else [], self.workers):
            for c in group:
                c.signal(signal.SIGTERM)
            deadline = time.monotonic() + self.cfg.stop_timeout_s
            for c in group:
                if c.wait(deadline - time.monotonic()) is None:
                    log.error(
                        "%s (pid %d) did not stop within %.0fs; SIGKILL",
                        c.name,
                        c.pid,
                        self.cfg.stop_timeout_s,
                    )
                    c.kill()
                    stuck = True
        if self.mps is not None:  # once its clients are gone
            stuck = self.mps.stop(self.cfg.stop_timeout_s) or stuck
        if self.children:
            log.info(
                "cluster stopped: %s",
                ", ".join(f"{c.name} exited {c.poll()}" for c in self.children),
            )
        return stuck
