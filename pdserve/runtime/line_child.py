"""A line child: a `python -m module` process that answers each line on its stdin with one line
on its stdout, every wait on it bounded. The parent's side is `LineChild`; the child's first
acts are `child_begins`, `cap_memory` and `say_ready`. The GBNF converter
(runtime/gbnf_converter.py) and the template jail's helpers (frontend/template_jail.py) are
line children.

- **Started with a deadline.** `start(deadline)` runs `python -m module <our pid> <memory>` with
  pipes, on the calling thread or on the `starter` given, and waits until `deadline` for its
  first line, READY (said once its imports are done): ChildNotStarted if it could not be
  started, exited, or was not ready in time. PR_SET_PDEATHSIG follows the *thread* that started
  a child, so one that must outlive its caller's thread is started on a `starter` that lives as
  long as the process; a starter found gone is ChildNotStarted, said so.
- **Every wait has a deadline.** `ask(line, deadline, limit)` writes into the child's
  non-blocking stdin and reads one line, both by `deadline`: NotTaken if the line was not all
  written (a child that reads no input: stopped or wedged, with the pipe full), Unanswered if
  no answer came, ChildDied at EOF or a broken pipe, TooLong past `limit` bytes. The owner
  decides whose fault each is, and kills the child after any of them.
- **Ended by pid.** `kill()`: SIGKILL, a reap bounded by KILL_WAIT_S, the pipes closed;
  `stop(wait_s)`: EOF first, then the same. `signal_kill()` only sends the SIGKILL, so any
  thread may call it while the owner's call is in flight (that call sees the child die).
- **Scrubbed environment.** The child gets `scrubbed_env`: the variables the owner names (what
  Python needs to start), nothing of pdserve's (the API key, the cluster key file's path), and
  this pdserve's directory first on PYTHONPATH, so it imports the same code however we did.
- **Bounded memory.** The child caps its address space (RLIMIT_AS) at what it has once its
  imports are done plus the `memory_bytes` it was given: past it, an allocation fails with
  MemoryError instead of taking the machine's memory.

Not thread-safe: its owner makes one call at a time (a lock, a queue of idle children).
"""

from __future__ import annotations

import logging
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, Future
from pathlib import Path

from pdserve.runtime.child import die_with_parent

log = logging.getLogger(__name__)

READY = b"ready\n"  # a child's first line, once its imports are done
KILL_WAIT_S = 5.0  # reaping a child after SIGKILL
READ_CHUNK = 1 << 20


class ChildNotStarted(OSError):
    """The child could not be started, exited before READY, or was not ready by the deadline."""


class ChildDied(OSError):
    """The child died under a call (EOF, or a broken pipe)."""


class NotTaken(TimeoutError):
    """The child did not take the whole line by the deadline: it reads no input."""


class Unanswered(TimeoutError):
    """The child took the line but did not answer it by the deadline."""


class TooLong(ValueError):
    """The child's answer ran past the caller's limit."""


class LineChild:
    """One `python -m module` child at a time, asked a line and answering one."""

    def __init__(
        self,
        module: str,
        name: str,
        *,
        memory_bytes: int,
        passed_env: frozenset[str],
        passed_prefixes: tuple[str, ...] = (),
        starter: Executor | None = None,
    ) -> None:
        """`name` says what the child is in messages ("the GBNF converter"); `starter`: the
        thread children are started on (None: the calling thread)."""
        self.module = module
        self.name = name
        self.memory_bytes = memory_bytes
        self.passed_env = passed_env
        self.passed_prefixes = passed_prefixes
        self.starter = starter
        self._starter_thread: threading.Thread | None = None  # seen when it started one
        self._proc: subprocess.Popen[bytes] | None = None

    def pid(self) -> int | None:
        """The running child's pid, if there is one."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def running(self) -> bool:
        return self.pid() is not None

    def start(self, deadline: float) -> None:
        """A fresh child (the one before killed, if any), ready by `deadline`; ChildNotStarted
        if not."""
        self.kill()
        t0 = time.monotonic()
        argv = [sys.executable, "-m", self.module, str(os.getpid()), str(self.memory_bytes)]
        env = scrubbed_env(os.environ, self.passed_env, self.passed_prefixes)
        proc = self._popen(argv, env, deadline)
        self._proc = proc
        assert proc.stdin is not None and proc.stdout is not None  # started with pipes
        os.set_blocking(proc.stdin.fileno(), False)  # writes wait in poll, by their deadline
        try:
            ready = _read_line(proc.stdout.fileno(), deadline, len(READY))
        except OSError:
            ready = b""
        if ready != READY:
            self.kill()
            how = f"within {deadline - t0:.3g}s" if ready is None else "(it exited)"
            raise ChildNotStarted(f"{self.name} did not start {how}")

    def ask(self, line: bytes, deadline: float, limit: int | None = None) -> bytes:
        """`line` (one, with its newline) written to the running child and its answer, one
        line with its newline, both by `deadline`. NotTaken, Unanswered, ChildDied, TooLong
        (past `limit` bytes): see the module's header."""
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            raise RuntimeError(f"{self.name} was asked before it was started")
        try:
            taken = _write_all(proc.stdin.fileno(), line, deadline)
            answer = _read_line(proc.stdout.fileno(), deadline, limit) if taken else None
        except OSError as e:  # EPIPE: it is gone
            raise ChildDied(f"{self.name} died ({e})") from None
        if not taken:
            raise NotTaken(f"{self.name} did not take its input")
        if answer is None:
            raise Unanswered(f"{self.name} did not answer")
        if not answer:
            raise ChildDied(f"{self.name} died")
        if not answer.endswith(b"\n"):
            raise TooLong(f"{self.name}'s answer is longer than {limit} bytes")
        return answer

    def kill(self) -> None:
        """SIGKILL (by pid), a reap bounded by KILL_WAIT_S, the pipes closed."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _end(proc)

    def stop(self, wait_s: float) -> None:
        """EOF on its stdin, `wait_s` for it to exit, then `kill`."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:  # a broken pipe: it is gone already
                log.debug("%s pid %d was gone at EOF", self.name, proc.pid)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            log.info("%s pid %d did not exit %gs after EOF", self.name, proc.pid, wait_s)
        _end(proc)

    def signal_kill(self) -> None:
        """SIGKILL (by pid) without reaping: safe from any thread, while a call is in flight."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def forget(self) -> None:
        """In a forked process: the parent's child and starter are not its own; close the
        pipes, kill nothing."""
        proc, self._proc = self._proc, None
        self._starter_thread = None
        for pipe in (proc.stdin, proc.stdout) if proc is not None else ():
            if pipe is not None:
                pipe.close()

    def _popen(
        self, argv: list[str], env: dict[str, str], deadline: float
    ) -> subprocess.Popen[bytes]:
        def popen() -> subprocess.Popen[bytes]:
            if self.starter is not None:
                self._starter_thread = threading.current_thread()
            return subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=env
            )

        if self.starter is None:
            try:
                return popen()
            except OSError as e:  # out of processes or descriptors, no interpreter
                raise ChildNotStarted(f"{self.name} could not be started: {e}") from e
        keeper = self._starter_thread
        if keeper is not None and not keeper.is_alive():
            raise ChildNotStarted(
                f"{self.name} could not be started: its starter thread {keeper.name} is gone "
                "(the interpreter is exiting?)"
            )
        try:
            job = self.starter.submit(popen)
        except RuntimeError as e:  # the interpreter is shutting down
            raise ChildNotStarted(f"{self.name} could not be started: {e}") from e
        try:
            return job.result(max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            job.add_done_callback(_end_late)
            raise ChildNotStarted(f"{self.name} was not started in time") from None
        except OSError as e:
            raise ChildNotStarted(f"{self.name} could not be started: {e}") from e


def scrubbed_env(
    parent: Mapping[str, str], passed: frozenset[str], prefixes: tuple[str, ...] = ()
) -> dict[str, str]:
    """A child's environment: `passed` and the variables starting with `prefixes` from
    `parent`, with this pdserve's directory first on PYTHONPATH."""
    env = {k: v for k, v in parent.items() if k in passed or (prefixes and k.startswith(prefixes))}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _end(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL (by pid), reap within KILL_WAIT_S, close the pipes."""
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        log.warning("child pid %d not reaped %gs after SIGKILL", proc.pid, KILL_WAIT_S)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def _end_late(job: Future[subprocess.Popen[bytes]]) -> None:
    """A child whose start was given up on: ended once it is started."""
    if not job.cancelled() and job.exception() is None:
        _end(job.result())


def _write_all(fd: int, data: bytes, deadline: float) -> bool:
    """All of `data` into the non-blocking `fd` by `deadline` (False if not)."""
    view = memoryview(data)
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    while view:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            return False
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            continue
    return True


def _read_line(fd: int, deadline: float, limit: int | None) -> bytes | None:
    """One line from `fd` (or its first `limit`+ bytes, without the newline); b"" at EOF;
    None past `deadline`."""
    buf = bytearray()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            return None
        chunk = os.read(fd, READ_CHUNK)
        if not chunk:
            return b""
        buf += chunk
        if buf.endswith(b"\n") or (limit is not None and len(buf) > limit):
            return bytes(buf)


# -- the child's side -----------------------------------------------------------------------
def child_begins(argv: Sequence[str]) -> int:
    """A line child's first act, given its arguments (our pid, its memory allowance): it dies
    with its parent (runtime/child.py), leaves the terminal's ^C to the parent, and returns the
    allowance, for `cap_memory` once its imports are done."""
    parent, memory_bytes = int(argv[0]), int(argv[1])
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return memory_bytes


def cap_memory(extra: int) -> None:
    """This process's address space capped at its size now plus `extra` (the hard limit kept)."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * page
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = size + extra if hard == resource.RLIM_INFINITY else min(size + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def say_ready() -> None:
    """READY on stdout: the parent's `start` returns."""
    out = sys.stdout.buffer
    out.write(READY)
    out.flush()
