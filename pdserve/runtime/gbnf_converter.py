"""The GBNF converter: llama.cpp's GBNF grammars turned into Lark text in a child process.

llguidance converts GBNF with a pure-Python parser (`llguidance.gbnf_to_lark`) that holds the
GIL throughout: a chain of 2,000 rules takes seconds, and every other thread of the process (an
engine's loop, an event loop) stalls with it. So a serving process never runs it: it hands the
text to one child (`python -m pdserve.runtime.gbnf_converter`, a line child:
runtime/line_child.py) and waits on a pipe, which holds no GIL. protocol/constraint.py's
`grammar_source` takes `GBNF_CONVERTER.convert` as its `to_lark`; a Lark grammar needs no
conversion and never comes here.

- **One child, lazy, replaced.** Started by the first conversion and kept; one that died or was
  killed is replaced by the next call, and a call whose child dies under it tries once more on
  a fresh one. Dying there too is ConverterDown: a grammar cannot kill the child (its memory
  is capped, and a MemoryError is answered as the converter's error), so a death is the
  server's trouble (an outside kill), never remembered against the grammar.
- **Whose fault a timeout is.** `convert(gbnf, timeout_s)`: its turn (conversions take turns)
  and the child's start must come within START_SHARE of `timeout_s`, else ConverterDown (the
  server's trouble); the grammar then has until `timeout_s` from the call to convert, so at
  least the rest. Past that the child is killed, by pid, and the call is ConversionTimeout
  (the grammar costs too much) if the grammar was written to the first child, else
  ConverterDown (a child that did not take it, a retry that started late). The next call
  starts a fresh child. The caller gives a `timeout_s` inside its compile's bound
  (protocol/constraint.py), so the conversion's outcome, busy or too costly, is decided before
  the compile's deadline. What this cannot tell apart: a child stopped from outside with the
  grammar in its pipe reads as a slow conversion.
- **Dies with its parent; the keeper.** The child's first act is `die_with_parent`
  (runtime/child.py). The kernel sends that signal when the *thread* that started the child
  ends, and grammar threads are retired after a timeout, so children are started by one
  keeper thread, a one-thread executor's worker that lives as long as the process. It is not
  under the supervisor (runtime/supervisor.py) because there is nothing to supervise: it runs
  no loop of its own and sits idle in its executor's queue between starts; it ends only at
  interpreter exit, when the kernel kills the child with it, as it should. A start that finds
  it gone is ConverterDown, said so.
- **Text in, text out.** One typed JSON line each way: the GBNF text; the Lark text or the
  converter's error, at most MAX_REPLY_BYTES. The reply is grammar text that llguidance then
  compiles and checks like any Lark grammar; nothing of it is executed or opened. The child
  gets the environment Python needs and nothing of pdserve's, its address space is capped at
  MEMORY_BYTES past its imports, and it converts on a thread with the grammar thread's stack,
  so it fails where the in-process converter fails.
- **Cached.** The outcomes (Lark text or error) of the last CACHE_SIZE distinct texts are kept:
  a grammar asked again (each hop, the engine after the front end's check) costs one
  conversion per process. `clear()` forgets them.
- A forked process starts with no child and a keeper of its own (its parent's are not its).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import msgspec
from llguidance.gbnf_to_lark import gbnf_to_lark

from pdserve.runtime.line_child import (
    KILL_WAIT_S,
    ChildDied,
    ChildNotStarted,
    LineChild,
    NotTaken,
    TooLong,
    Unanswered,
    cap_memory,
    child_begins,
    say_ready,
)

log = logging.getLogger(__name__)

MODULE = "pdserve.runtime.gbnf_converter"  # the child's `python -m`
CACHE_SIZE = 64  # distinct GBNF texts whose outcome is kept
MAX_REPLY_BYTES = 8 << 20  # one reply line (a 128 KiB grammar's Lark text is far less)
START_SHARE = 0.5  # of a call's timeout: for its turn and the child's start
MEMORY_BYTES = 256 << 20  # the child's address space past its imports (a conversion: < 16 MiB)
CHILD_STACK_BYTES = 256 << 20  # the converting thread's, as the grammar thread's
# What the child keeps of its parent's environment: what Python needs to start and find its
# packages. No PDSERVE_* variable (the API key, the cluster key file's path).
PASSED_ENV = frozenset(
    {"PATH", "HOME", "PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "LD_LIBRARY_PATH", "LANG"}
)


class Ask(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    gbnf: str


class Converted(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="lark"):
    lark: str


class Refused(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="refused"):
    error: str  # the converter's message


Reply = Converted | Refused
_ASK = msgspec.json.Decoder(Ask)
_REPLY = msgspec.json.Decoder(Reply)
_ENCODE = msgspec.json.Encoder()


class ConversionTimeout(TimeoutError):
    """The child did not convert the grammar within its bound: it costs too much."""


class ConverterDown(OSError):
    """The grammar was not converted: its turn or the child's start did not come within the
    bound, or the child misbehaved or died (the server's trouble, not the grammar's)."""


class GbnfConverter:
    """GBNF text -> Lark text in one child process, each call within its timeout."""

    def __init__(self, cache_size: int = CACHE_SIZE, memory_bytes: int = MEMORY_BYTES) -> None:
        self.cache_size = cache_size
        self.memory_bytes = memory_bytes
        self._turn = threading.Lock()  # held by the call whose grammar the child has
        self._cache_lock = threading.Lock()
        self._cache: OrderedDict[str, Reply] = OrderedDict()
        self._child = self._new_child()
        self.started = 0  # children started
        self.conversions = 0  # grammars the child converted (cache misses)

    def convert(self, gbnf: str, timeout_s: float) -> str:
        """The Lark text of `gbnf`; ValueError (the converter's message) if it does not
        convert; ConversionTimeout if the child did not convert it in its time;
        ConverterDown if it was not converted for the server's trouble (see the header)."""
        reply = self._cached(gbnf)
        if reply is None:
            now = time.monotonic()
            ready_by, deadline = now + timeout_s * START_SHARE, now + timeout_s
            if not self._turn.acquire(timeout=max(ready_by - now, 0.0)):
                raise ConverterDown(
                    "the GBNF converter was busy with another grammar for "
                    f"{timeout_s * START_SHARE:.2g}s"
                )
            try:
                reply = self._cached(gbnf)  # converted while this call waited its turn
                if reply is None:
                    reply = self._ask(gbnf, ready_by, deadline)
                    self._remember(gbnf, reply)
            finally:
                self._turn.release()
        if isinstance(reply, Refused):
            raise ValueError(reply.error)
        return reply.lark

    def pid(self) -> int | None:
        """The running child's pid, if there is one (tests, diagnostics)."""
        return self._child.pid()

    def clear(self) -> None:
        """Forget every conversion's outcome (tests)."""
        with self._cache_lock:
            self._cache.clear()

    def close(self) -> None:
        """Kill the child, by pid, and reap it; the next call starts a fresh one. A call in
        flight sees its child die: it retries on a fresh child, which this kills once that
        call is done (it waits for the turn at most KILL_WAIT_S)."""
        self._child.signal_kill()
        if self._turn.acquire(timeout=KILL_WAIT_S):
            try:
                self._child.kill()
            finally:
                self._turn.release()
        else:
            log.warning("the GBNF converter's call in flight kept it past %gs", KILL_WAIT_S)

    # -- under the turn ---------------------------------------------------------------------
    def _ask(self, gbnf: str, ready_by: float, deadline: float) -> Reply:
        request = _ENCODE.encode(Ask(gbnf=gbnf)) + b"\n"
        for first, start_by in ((True, ready_by), (False, deadline)):  # a retry: what is left
            self._running(start_by)
            given_at = time.monotonic()
            try:
                line = self._child.ask(request, deadline, MAX_REPLY_BYTES)
            except ChildDied:  # killed from outside: once more, on a fresh child
                self._child.kill()
                continue
            except NotTaken:  # a child that takes no input: stopped, or wedged
                self._child.kill()
                raise ConverterDown(
                    f"the GBNF converter did not take the grammar within {deadline - given_at:.2g}s"
                ) from None
            except Unanswered:
                self._child.kill()
                if not first:  # it had less than its time: not the grammar's doing
                    raise ConverterDown(
                        "the GBNF converter's replacement did not convert the grammar in the "
                        "time left"
                    ) from None
                raise ConversionTimeout(
                    f"the GBNF grammar did not convert within {deadline - given_at:.2g}s"
                ) from None
            except TooLong:
                self._child.kill()
                self.conversions += 1
                return Refused(error=f"its Lark text is longer than {MAX_REPLY_BYTES} bytes")
            self.conversions += 1
            try:
                return _REPLY.decode(line)
            except msgspec.DecodeError as e:  # a ValidationError too
                self._child.kill()
                raise ConverterDown(f"the GBNF converter answered out of form: {e}") from None
        raise ConverterDown("the GBNF converter died converting the grammar, twice")

    def _running(self, start_by: float) -> None:
        """The child running: the live one, or a fresh one ready by `start_by`."""
        if self._child.running():
            return
        try:
            self._child.start(start_by)
        except ChildNotStarted as e:
            raise ConverterDown(str(e)) from None
        self.started += 1

    def _new_child(self) -> LineChild:
        return LineChild(
            MODULE,
            "the GBNF converter",
            memory_bytes=self.memory_bytes,
            passed_env=PASSED_ENV,
            starter=ThreadPoolExecutor(1, thread_name_prefix="gbnf-keeper"),
        )

    # -- the cache --------------------------------------------------------------------------
    def _cached(self, gbnf: str) -> Reply | None:
        with self._cache_lock:
            reply = self._cache.get(gbnf)
            if reply is not None:
                self._cache.move_to_end(gbnf)
            return reply

    def _remember(self, gbnf: str, reply: Reply) -> None:
        with self._cache_lock:
            self._cache[gbnf] = reply
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def _forget_child(self) -> None:
        """In a forked process: the parent's child and keeper thread are not its own."""
        self._turn = threading.Lock()
        self._cache_lock = threading.Lock()
        self._child.forget()
        self._child = self._new_child()


GBNF_CONVERTER = GbnfConverter()
os.register_at_fork(after_in_child=GBNF_CONVERTER._forget_child)


# -- the child ----------------------------------------------------------------------------
def _convert(line: bytes) -> Reply:
    try:
        gbnf = _ASK.decode(line).gbnf
    except msgspec.DecodeError as e:
        return Refused(error=f"the converter's request is malformed: {e}")
    try:
        return Converted(lark=gbnf_to_lark(gbnf))
    except MemoryError:
        return Refused(error="converting it needs too much memory")
    except Exception as e:  # noqa: BLE001 - it raises anything on bad text (as llguidance.grammar_from catches)
        return Refused(error=str(e) or type(e).__name__)


def _serve(memory_bytes: int) -> None:
    cap_memory(memory_bytes)  # after the imports and this thread's stack: they are not a grammar's
    say_ready()
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:  # until EOF
        out.write(_ENCODE.encode(_convert(line)) + b"\n")
        out.flush()


def main(argv: list[str]) -> int:
    memory_bytes = child_begins(argv)
    threading.stack_size(CHILD_STACK_BYTES)
    thread = threading.Thread(target=_serve, args=(memory_bytes,), name="gbnf-convert")
    thread.start()
    thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
