"""`pdserve router --processes N`: one port served by N router processes.

Why: a router streams every client's tokens from one event loop, at a fixed CPU cost a chunk.
At concurrency 128 one process falls behind and merges tokens into fewer, later chunks while
the engine keeps its step (benchmarks/RESULTS.md, 2026-12-03 calls 4 and 5). vLLM meets the
same limit with --api-server-count.

How:
* This process (the parent) holds the port: bound with SO_REUSEPORT but never listening (a
  socket that listens and never accepts would be handed connections). Then it starts N
  children, each a whole `pdserve router` with `--reuse-port` on that port: the kernel spreads
  new connections over the children listening there, and a connection stays with its child.
  Each child discovers the fleet, keeps its own output channel to every worker, its own
  health loop and canary, and answers /health, /metrics and /debug for itself.
* Each child's stdout is a pipe to the parent, which reads its READY line; once every child
  has printed one, the parent prints its own: whoever started the router (`pdserve launch`)
  sees one router. A child's log lines go to the parent's stderr, tagged `router-<i>`.
* Children run in their own process group, so a terminal's Ctrl-C reaches the parent alone,
  and the parent passes every SIGINT/SIGTERM on to each child once: the first makes each
  drain as a single router does, a second makes each stop at once. A child still running
  past its drain and stop bounds is killed. Children die with the parent (PR_SET_PDEATHSIG).
* A child that exits while serving is started again (its clients' streams broke with it, the
  others' did not), at most MAX_RESTARTS times in POOL_RESTART_WINDOW_S; past that every child
  is stopped and the parent exits 1. A child that fails before READY fails the start.
* Metrics: every child keeps its series in files in one directory (PROMETHEUS_MULTIPROC_DIR,
  router/metrics.py), so a scrape of any child answers for all of them.
* Per child: `--max-queue` (each takes an equal share), `--policy prefix`'s index (each learns
  from what it routes), /debug/cluster (the answering child's view, with its pid).
"""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from typing import IO, Any

from pdserve.router.config import RouterConfig
from pdserve.router.metrics import SHARED_DIR_ENV
from pdserve.runtime.child import _die_with_parent
from pdserve.runtime.logs import TAG_ENV
from pdserve.runtime.ready import announce_ready
from pdserve.runtime.timing import (
    POOL_POLL_S,
    POOL_RESTART_WINDOW_S,
    POOL_START_GRACE_S,
    POOL_STOP_GRACE_S,
)
from pdserve.server.listener import bind, bind_error

log = logging.getLogger(__name__)

MAX_PROCESSES = 64
MAX_RESTARTS = 3  # child restarts allowed within POOL_RESTART_WINDOW_S


def child_argv(argv: list[str], port: int, max_queue: int) -> list[str]:
    """A child's command line: the parent's own `pdserve` arguments, then (argparse keeps
    an option's last value) one process, the parent's port shared, its share of the queue."""
    return [
        sys.executable,
        "-m",
        "pdserve",
        *argv,
        "--processes",
        "1",
        "--reuse-port",
        "--port",
        str(port),
        "--max-queue",
        str(max_queue),
    ]


class RouterProcess:
    """One child router: its process, its output pipe, whether it printed READY."""

    def __init__(self, index: int, argv: list[str], env: dict[str, str]) -> None:
        self.index = index
        self.argv = argv
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready = False
        self.url: str | None = None
        self._pending = b""  # an unfinished line of its stdout

    @property
    def name(self) -> str:
        return f"router-{self.index}"

    @property
    def pid(self) -> int:
        assert self.proc is not None  # started before anyone asks
        return self.proc.pid

    @property
    def stdout(self) -> IO[bytes]:
        assert self.proc is not None and self.proc.stdout is not None
        return self.proc.stdout

    def start(self) -> None:
        self.ready, self.url, self._pending = False, None, b""
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=None,  # the parent's: its log lines, tagged
            env={**os.environ, **self.env, TAG_ENV: self.name, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # signals reach it from the parent alone, once each
            preexec_fn=_die_with_parent(),
        )
        os.set_blocking(self.stdout.fileno(), False)

    def read(self) -> bool:
        """Take what its stdout has now: READY sets `ready`; other lines go to our stderr.
        False at the end of its output (it exited)."""
        try:
            data = os.read(self.stdout.fileno(), 65536)
        except BlockingIOError:
            return True
        if not data:
            return False
        self._take(data)
        return True

    def drain(self) -> None:
        """Read what is left of its output, without waiting for more (it exited)."""
        while True:
            try:
                data = os.read(self.stdout.fileno(), 65536)
            except BlockingIOError:
                return
            if not data:
                return
            self._take(data)

    def _take(self, data: bytes) -> None:
        *lines, self._pending = (self._pending + data).split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            if line.startswith("READY ") and not self.ready:
                self.ready, self.url = True, line.split()[1]
            elif line:
                print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Pool:
    def __init__(self, cfg: RouterConfig, argv: list[str], processes: int, port: int) -> None:
        self.cfg = cfg
        self.metrics_dir = tempfile.mkdtemp(prefix="pdserve-router-metrics-")
        share = max(1, -(-cfg.max_queue // processes))
        env = {SHARED_DIR_ENV: self.metrics_dir}
        self.children = [
            RouterProcess(i, child_argv(argv, port, share), env) for i in range(processes)
        ]
        self.port = port
        self.selector = selectors.DefaultSelector()
        self.signals: deque[int] = deque()  # received, not yet passed on
        self.restarts: deque[float] = deque()  # when children were restarted

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = self._start()
            if code is None:
                code = self._serve()
        finally:
            code_after_stop = self._stop_all()
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.selector.close()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        return code if code else code_after_stop

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signals.append(signum)

    def _spawn(self, child: RouterProcess) -> None:
        child.start()
        self.selector.register(child.stdout, selectors.EVENT_READ, child)
        log.info("started %s (pid %d)", child.name, child.pid)

    def _pump(self, timeout_s: float) -> None:
        """Read every child's output that arrives within `timeout_s`."""
        for key, _ in self.selector.select(timeout_s):
            child: RouterProcess = key.data
            if not child.read():
                self.selector.unregister(key.fileobj)

    def _start(self) -> int | None:
        """Start every child and wait for its READY; None once all serve, else the code."""
        for child in self.children:
            self._spawn(child)
        deadline = time.monotonic() + self.cfg.startup_timeout_s + POOL_START_GRACE_S
        while not all(c.ready for c in self.children):
            self._pump(POOL_POLL_S)
            if self.signals:
                log.info("signal %d during startup: stopping", self.signals[0])
                return 0
            for c in self.children:
                code = c.poll()
                if code is not None and not c.ready:
                    log.error("%s (pid %d) exited with %d before serving", c.name, c.pid, code)
                    return code or 1
            if time.monotonic() > deadline:
                late = [c.name for c in self.children if not c.ready]
                log.error("%s printed no READY line in time", ", ".join(late))
                return 1
        url = self.children[0].url
        log.info("%d router processes serve %s", len(self.children), url)
        announce_ready(str(url))
        return None

    def _serve(self) -> int | None:
        """Until a signal (None: stop normally) or too many child deaths (1)."""
        while not self.signals:
            self._pump(POOL_POLL_S)
            for c in self.children:
                code = c.poll()
                if code is None:
                    continue
                self._reap(c)
                now = time.monotonic()
                while self.restarts and now - self.restarts[0] > POOL_RESTART_WINDOW_S:
                    self.restarts.popleft()
                if len(self.restarts) >= MAX_RESTARTS:
                    log.error(
                        "!!! %s (pid %d) exited with %d, the %dth child to in %.0fs: stopping",
                        c.name,
                        c.pid,
                        code,
                        MAX_RESTARTS + 1,
                        POOL_RESTART_WINDOW_S,
                    )
                    return 1
                log.error("!!! %s (pid %d) exited with %d; starting it again", c.name, c.pid, code)
                self.restarts.append(now)
                self._spawn(c)
        return None

    def _reap(self, child: RouterProcess) -> None:
        """A child that exited: its output read to the end, its live gauges dropped."""
        from prometheus_client.multiprocess import mark_process_dead

        try:
            self.selector.unregister(child.stdout)
        except (KeyError, ValueError):
            pass  # its end of output was already read
        else:
            child.drain()
        mark_process_dead(child.pid, self.metrics_dir)

    def _stop_all(self) -> int:
        """Pass every signal on (SIGTERM if none came), wait for the children within their
        drain and stop bounds, kill what is left; 0, a child's exit code, or 1 if killed."""
        live = [c for c in self.children if c.poll() is None]
        if not self.signals:
            self.signals.append(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.drain_timeout_s + POOL_STOP_GRACE_S
        while live and time.monotonic() < deadline:
            while self.signals:
                sig = self.signals.popleft()
                for c in live:
                    c.signal(sig)
            self._pump(POOL_POLL_S)
            live = [c for c in live if c.poll() is None]
        codes = []
        for c in self.children:
            if c.poll() is None:
                log.error("%s (pid %d) did not stop in time; SIGKILL", c.name, c.pid)
                c.kill()
                codes.append(1)
            elif c.proc is not None:
                codes.append(c.poll() or 0)
        return next((code for code in codes if code), 0)


def run_pool(cfg: RouterConfig, argv: list[str], processes: int) -> int:
    """Hold the port, run `processes` routers on it until stopped: the exit status (2: the
    port cannot be had)."""
    try:
        held = bind(cfg.host, cfg.port, reuse_port=True, listen=False)
    except OSError as e:
        log.error("%s", bind_error(cfg.host, cfg.port, e))
        return 2
    try:
        port = held[0].getsockname()[1]
        return Pool(cfg, argv, processes, port).run()
    finally:
        for s in held:
            s.close()
