"""Supervisor: every long-lived thread runs under it, so no thread can die unnoticed.

A supervised thread is a loop of `tick()` calls. Around every tick the supervisor records a
heartbeat; an exception escaping a tick is logged, counted, and the loop goes on, until the
thread has crashed more than `restart_budget` times within `budget_window_s`. Then the thread
is declared dead, `healthy()` turns false, and `on_fatal` is called so the process exits
loudly instead of living on half-alive. A `kill:0` fault (runtime/faults.py) takes the same
road at once, and so does a tick that raises `ThreadFatal` (its thread cannot go on: a
tensor-parallel group out of step). `threading.excepthook` catches anything else.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.runtime.faults import FAULTS, ThreadKilled

log = logging.getLogger(__name__)


class ThreadFatal(RuntimeError):
    """Raised by a tick that must not run again: its thread is declared dead at once, with
    this message as the reason (/health shows it), and the process stops."""


@dataclass
class ThreadRecord:
    name: str
    heartbeat_timeout_s: float
    last_heartbeat: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.monotonic)
    crashes: deque[float] = field(default_factory=deque)
    total_crashes: int = 0
    last_error: str | None = None
    alive: bool = True
    dead_reason: str | None = None

    def stale_for(self, now: float) -> float:
        return now - self.last_heartbeat


class Supervisor:
    def __init__(
        self,
        restart_budget: int = 5,
        budget_window_s: float = 60.0,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.restart_budget = restart_budget
        self.budget_window_s = budget_window_s
        self.on_fatal = on_fatal
        self._records: dict[str, ThreadRecord] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._prev_excepthook = threading.excepthook
        threading.excepthook = self._excepthook

    # -- running threads ---------------------------------------------------------------
    def spawn(
        self, name: str, tick: Callable[[], None], heartbeat_timeout_s: float = 5.0
    ) -> threading.Thread:
        """Run `tick` in a loop on a new daemon thread until `stop()`.

        `tick` must return within `heartbeat_timeout_s` (block on queues with a timeout).
        """
        rec = ThreadRecord(name=name, heartbeat_timeout_s=heartbeat_timeout_s)
        with self._lock:
            if name in self._records and self._records[name].alive:
                raise ValueError(f"a supervised thread named {name!r} is already running")
            self._records[name] = rec
        t = threading.Thread(target=self._run, args=(rec, tick), name=name, daemon=True)
        self._threads[name] = t
        t.start()
        return t

    def _run(self, rec: ThreadRecord, tick: Callable[[], None]) -> None:
        while not self._stop.is_set() and rec.alive:
            rec.last_heartbeat = time.monotonic()
            try:
                FAULTS.hit(f"thread.{rec.name}")
                tick()
            except ThreadFatal as e:  # no restart can help
                self._record_crash(rec, e)
                self.declare_dead(rec.name, str(e))
            except ThreadKilled as e:  # a fault point's `kill`: a crash, maybe a final one
                self._record_crash(rec, e)
                if not e.restart:
                    self.declare_dead(rec.name, str(e))
            except Exception as e:  # noqa: BLE001 - the supervisor's whole job
                self._record_crash(rec, e)
        rec.last_heartbeat = time.monotonic()

    def _record_crash(self, rec: ThreadRecord, e: BaseException) -> None:
        now = time.monotonic()
        rec.total_crashes += 1
        rec.last_error = f"{type(e).__name__}: {e}"
        rec.crashes.append(now)
        while rec.crashes and now - rec.crashes[0] > self.budget_window_s:
            rec.crashes.popleft()
        log.error(
            "thread %s crashed (%d in window): %s\n%s",
            rec.name,
            len(rec.crashes),
            rec.last_error,
            "".join(traceback.format_exception(e)),
        )
        if len(rec.crashes) > self.restart_budget:
            self.declare_dead(rec.name, f"restart budget exhausted: {rec.last_error}")

    def declare_dead(self, name: str, reason: str) -> None:
        rec = self._records[name]
        if not rec.alive:
            return
        rec.alive = False
        rec.dead_reason = reason
        log.critical("supervised thread %s is dead: %s", name, reason)
        if self.on_fatal is not None:
            self.on_fatal(f"thread {name} dead: {reason}")

    def _excepthook(self, args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread is not None else "?"
        if name in self._records:
            self.declare_dead(name, f"uncaught {args.exc_type.__name__}: {args.exc_value}")
        self._prev_excepthook(args)

    # -- health ------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Why this process is not healthy; empty when every thread is alive and fresh."""
        now = time.monotonic()
        out = []
        for rec in self._records.values():
            if not rec.alive:
                out.append(f"thread {rec.name} dead: {rec.dead_reason}")
            elif rec.stale_for(now) > rec.heartbeat_timeout_s:
                out.append(f"thread {rec.name} heartbeat stale for {rec.stale_for(now):.1f}s")
        return out

    def snapshot(self) -> list[dict[str, object]]:
        now = time.monotonic()
        return [
            {
                "name": r.name,
                "alive": r.alive,
                "heartbeat_age_s": round(r.stale_for(now), 3),
                "heartbeat_timeout_s": r.heartbeat_timeout_s,
                "crashes": r.total_crashes,
                "last_error": r.last_error,
                "dead_reason": r.dead_reason,
            }
            for r in self._records.values()
        ]

    # -- lifecycle ---------------------------------------------------------------------
    def stop(self, timeout_s: float = 5.0) -> list[str]:
        """Ask every loop to finish; returns the names of threads that did not stop in time."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        stuck = []
        for name, t in self._threads.items():
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                stuck.append(name)
        threading.excepthook = self._prev_excepthook
        return stuck
