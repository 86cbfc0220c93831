"""The grammar thread: every llguidance compile (a constraint checked, a matcher built) runs on
one long-lived thread with a large stack.

llguidance's compiler recurses once per grammar rule and once per JSON-schema `$ref` link, a few
KiB of stack each: a chain of 3,000 Lark rules (49 KB, far under MAX_CONSTRAINT_BYTES) or of
1,000 `$ref`s overflows a thread's default 8 MiB, and the overflow is a SIGSEGV that takes the
whole process. The longest chain a 128 KiB spec can hold (~16,500 one-line rules) needs 32 to
64 MiB; this thread has STACK_BYTES (256 MiB of address space, of which only what a compile
touches is ever resident), so no spec within the size bound reaches its end.

- **Lazy and shared.** One per process (`GRAMMAR_THREAD`), started by the first call, from
  whichever thread makes it: the event loop, the engine thread, a worker's control thread.
  `threading.stack_size` is process-wide, so it is set under the lock just around the start
  and restored (a thread another caller starts in that instant gets the big stack too, which
  costs only address space). A call made on the grammar thread itself runs inline.
- **Bounded waits.** `run` waits at most its timeout (COMPILE_TIMEOUT_S), queueing included;
  `submit` queues the call and returns a `Pending` that a loop polls (`ready`, `outcome`)
  under the same deadline, so the engine thread never waits on a compile.
  A compile cannot be interrupted, so one that runs past its caller's deadline is
  CompileTimeout (the spec's fault: it costs too much) and its thread is retired: it finishes
  that compile and exits, and a fresh thread takes the queue. At most MAX_THREADS run at
  once, retired ones included; past that, or when a call's turn did not come within its
  deadline, it is CompilerBusy (the server's trouble) and the call is dropped from the queue.
  A retired thread that finishes while no thread serves the queue serves it again. A forked
  child starts with none (the parent's threads are not in it).

llguidance releases the GIL while it compiles, so the other threads run meanwhile. Torch-free.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

STACK_BYTES = 256 << 20
COMPILE_TIMEOUT_S = 10.0  # one call, its wait for the thread included
MAX_THREADS = 4  # grammar threads alive at once, retired ones (still compiling) included

T = TypeVar("T")


class CompileTimeout(RuntimeError):
    """A compile ran past its deadline: the grammar is too costly (the client's fault)."""


class CompilerBusy(RuntimeError):
    """A compile did not start within its deadline (the server's trouble)."""


@dataclass
class _Job(Generic[T]):
    fn: Callable[..., T]
    args: tuple[Any, ...]
    done: threading.Event = field(default_factory=threading.Event)
    result: T | None = None
    error: BaseException | None = None
    worker: _Worker | None = None  # the thread running it, once one took it
    taken_at: float = 0.0  # time.monotonic() when a thread took it
    dropped: bool = False  # its caller stopped waiting before a thread took it

    def outcome(self) -> T:
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[return-value]  # set whenever error is not


@dataclass
class _Worker:
    retired: bool = False  # it exits after the call it is running (unless none serves)


class Pending(Generic[T]):
    """A call on the grammar thread, not waited for: `ready()` once it finished or its
    deadline passed, then `outcome()`. Its deadline is `timeout` from when it was queued, or
    from when a thread took it if that was later (time queued behind others is not its own)."""

    def __init__(self, owner: GrammarThread, job: _Job[T], timeout: float) -> None:
        self._owner = owner
        self._job = job
        self._timeout = timeout
        self._queued_at = time.monotonic()
        self._error: BaseException | None = None  # past the deadline: CompileTimeout or busy

    def deadline(self) -> float:
        with self._owner._lock:
            taken = self._job.taken_at if self._job.worker is not None else None
        base = self._queued_at + self._timeout
        return base if taken is None else max(base, taken + self._timeout)

    def ready(self) -> bool:
        """Finished, or past its deadline (without waiting). Once True, `outcome()` is decided:
        a call past its deadline is given up here, atomically (busy, or timed out and its
        thread retired), so a thread taking it just after cannot move the deadline."""
        if self._job.done.is_set() or self._error is not None:
            return True
        if time.monotonic() < self.deadline():
            return False
        self._error = self._owner._give_up(self._job, self._timeout)
        return True  # finished meanwhile (no error) or given up

    def outcome(self) -> T:
        """The call's result or exception; CompileTimeout or CompilerBusy if it was given up.
        RuntimeError if it is not `ready()`."""
        if not self.ready():
            raise RuntimeError("a grammar call's outcome asked for before it is ready")
        if self._error is not None:
            raise self._error
        return self._job.outcome()

    def wait(self) -> T:
        """Block until `ready()`, then its `outcome()`."""
        while not self._job.done.is_set():
            left = self.deadline() - time.monotonic()
            if left <= 0:
                break
            self._job.done.wait(left)
        return self.outcome()


class GrammarThread:
    """Runs calls on a big-stack thread, one at a time, each within a deadline."""

    def __init__(
        self,
        stack_bytes: int = STACK_BYTES,
        timeout_s: float = COMPILE_TIMEOUT_S,
        max_threads: int = MAX_THREADS,
        name: str = "grammar",
    ) -> None:
        self.stack_bytes = stack_bytes
        self.timeout_s = timeout_s
        self.max_threads = max_threads
        self.name = name
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job[Any]] = queue.SimpleQueue()
        self._active: _Worker | None = None  # the thread serving the queue
        self._alive = 0  # threads running, retired ones included
        self._started = 0  # threads ever started
        self._local = threading.local()  # `on_thread` set on the grammar threads

    def run(self, fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
        """`fn(*args)` on the grammar thread, its result or its exception; CompileTimeout if
        it ran past `timeout_s` (default: this thread's), CompilerBusy if it never started."""
        if getattr(self._local, "on_thread", False):
            return fn(*args)
        return self.submit(fn, *args, timeout_s=timeout_s).wait()

    def submit(
        self, fn: Callable[..., T], *args: Any, timeout_s: float | None = None
    ) -> Pending[T]:
        """`fn(*args)` queued for the grammar thread, without waiting: the engine thread polls
        it (`Pending.ready`) between steps. CompilerBusy if no thread could be started."""
        job: _Job[T] = _Job(fn, args)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if getattr(self._local, "on_thread", False):  # inline, done at once
            try:
                job.result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - the caller gets it
                job.error = e
            job.done.set()
            return Pending(self, job, timeout)
        with self._lock:
            if self._active is None:
                self._start_locked()
            self._jobs.put(job)
        return Pending(self, job, timeout)

    def _give_up(self, job: _Job[T], timeout: float) -> BaseException | None:
        """Past `job`'s deadline: None if it finished meanwhile, else CompilerBusy (never
        taken: dropped from the queue) or CompileTimeout (its thread retired)."""
        with self._lock:
            if job.done.is_set():  # it finished as the wait ended
                return None
            worker = job.worker
            if worker is None:
                job.dropped = True
                return CompilerBusy(
                    f"the grammar compiler did not get to this constraint within {timeout:g}s "
                    "(it is busy with others); try again"
                )
            worker.retired = True
            if self._active is worker:
                self._active = None
                if self._alive < self.max_threads:
                    self._start_locked()
        return CompileTimeout(f"it did not compile within {timeout:g}s")

    def threads(self) -> tuple[int, int]:
        """(alive, ever started): for tests and diagnostics."""
        with self._lock:
            return self._alive, self._started

    def _start_locked(self) -> None:
        if self._alive >= self.max_threads:
            raise CompilerBusy(
                f"the grammar compiler is busy: {self._alive} compiles ran past their "
                "deadline and are still running; try again"
            )
        worker = _Worker()
        thread = threading.Thread(
            target=self._serve, args=(worker,), name=f"{self.name}-{self._started}", daemon=True
        )
        old = threading.stack_size(self.stack_bytes)
        try:
            thread.start()
        except RuntimeError as e:  # no thread could be made (memory, a process limit)
            raise CompilerBusy(f"the grammar compiler's thread could not start: {e}") from e
        finally:
            threading.stack_size(old)
        self._alive += 1
        self._started += 1
        self._active = worker

    def _serve(self, worker: _Worker) -> None:
        self._local.on_thread = True
        while True:
            job = self._jobs.get()
            with self._lock:
                if job.dropped:
                    continue
                job.worker = worker
                job.taken_at = time.monotonic()
            try:
                job.result = job.fn(*job.args)
            except BaseException as e:  # noqa: BLE001 - the caller gets it
                job.error = e
            job.done.set()
            with self._lock:
                if not worker.retired:
                    continue
                if self._active is None:  # nobody serves the queue: this thread does again
                    worker.retired = False
                    self._active = worker
                    continue
                self._alive -= 1
                return

    def _forget_threads(self) -> None:
        """In a forked child: none of the parent's threads exist there; start afresh."""
        self._lock = threading.Lock()
        self._jobs = queue.SimpleQueue()
        self._active = None
        self._alive = 0


GRAMMAR_THREAD = GrammarThread()
os.register_at_fork(after_in_child=GRAMMAR_THREAD._forget_threads)


def on_grammar_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the process's grammar thread (GRAMMAR_THREAD.run)."""
    return GRAMMAR_THREAD.run(fn, *args)


def on_grammar_thread_later(
    fn: Callable[..., T], *args: Any, timeout_s: float | None = None
) -> Pending[T]:
    """`fn(*args)` queued on the process's grammar thread, not waited for (its `submit`)."""
    return GRAMMAR_THREAD.submit(fn, *args, timeout_s=timeout_s)
