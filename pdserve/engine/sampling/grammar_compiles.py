"""The engine's grammar compiles: started and polled without waiting, kept in an LRU.

A grammar (engine/sampling/grammars.py) is compiled against the model's vocabulary on the
process's grammar thread (protocol/grammar_thread.py: a stack deep enough for any spec within
the size bound), and the engine thread never waits for it:

- **The vocabulary first.** llguidance's token table is built once, on the grammar thread, as
  its own job with VOCAB_TIMEOUT_S (a large tokenizer takes a while, and that is no spec's
  fault); each grammar's compile is queued once it exists, under COMPILE_TIMEOUT_S of its own.
- **`poll(c)`** starts `c`'s compile on first sight and says, without blocking, whether it is
  done: True (compiled), why not (it cannot compile, or the compiler could not take it), or
  False (still compiling). **`sweep()`**, once a tick, settles every compile that ended,
  polled or not, so an abandoned compile still retires its thread at its deadline and never
  lingers.
- **What is kept.** Compiled grammars (pristine matchers) in an LRU of `cache_size` (and
  those of the last sweep until the next, so a wave of more than fits still reaches its
  requests, which take their matchers as they see them compiled); refusals
  (it does not compile, or ran past its bound: the constraint's fault) in an LRU of the same
  size, so its other requests fail at once. A busy compiler (CompilerBusy, a vocabulary that
  could not be built) is the server's trouble: it fails the requests waiting on that
  grammar in this tick and is forgotten at the next sweep, so a later request asks again.
- **`compiled(c)`** waits, for callers outside the engine loop (tests, tools).
- **GBNF** is converted to Lark by the `to_lark` given (the engine's: runtime/gbnf_converter.py,
  in a child process, so the conversion never holds this process's GIL), within the compile's
  bound.

Only the engine thread uses this; it holds no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import llguidance

from pdserve.protocol.constraint import Constraint, ConstraintKind, ToLark, grammar_source
from pdserve.protocol.grammar_thread import (
    CompilerBusy,
    CompileTimeout,
    Pending,
    on_grammar_thread_later,
)

VOCAB_TIMEOUT_S = 120.0  # building the token table, once per engine
BUSY = "was not compiled"  # a refusal that is the compiler's trouble, not the constraint's
Key = tuple[ConstraintKind, str]
V = TypeVar("V")


class GrammarCompiles:
    """Compiled grammars of one vocabulary, built by `make_vocab()` on the grammar thread,
    GBNF converted by `to_lark`."""

    def __init__(
        self,
        make_vocab: Callable[[], llguidance.LLTokenizer],
        cache_size: int,
        to_lark: ToLark,
    ) -> None:
        self._make_vocab = make_vocab
        self._cache_size = cache_size
        self._to_lark = to_lark
        self._vocab: llguidance.LLTokenizer | None = None
        self._vocab_job: Pending[llguidance.LLTokenizer] | None = None
        self._compiled: OrderedDict[Key, llguidance.LLMatcher] = OrderedDict()
        self._refused: OrderedDict[Key, str] = OrderedDict()  # why each did not compile
        self._pending: dict[Key, Pending[llguidance.LLMatcher]] = {}  # compiling now
        self._busy: dict[Key, str] = {}  # the compiler's trouble, until the next sweep
        # Compiled by the last sweep, until the next: the requests waiting on them take their
        # matchers before an LRU smaller than the wave could evict them.
        self._fresh: dict[Key, llguidance.LLMatcher] = {}
        self._vocab_busy: str | None = None  # likewise for the vocabulary
        self.compiles = 0  # grammars compiled (cache misses)

    @property
    def vocab(self) -> llguidance.LLTokenizer:
        """The token table; built on the calling thread if no job built it yet (tools, tests)."""
        if self._vocab is None:
            self._vocab = self._make_vocab()
        return self._vocab

    def poll(self, c: Constraint) -> bool | str:
        """Without waiting: True once `c` is compiled, why not if it cannot compile (or the
        compiler could not take it), False while it compiles (the first poll starts that)."""
        key = (c.kind, c.spec)
        if key in self._compiled or key in self._fresh:
            return True
        why = self._refused.get(key) or self._busy.get(key)
        if why is not None:
            return why
        if key in self._pending:
            return False
        if self._vocab is None:
            return self._start_vocab()
        try:
            self._pending[key] = on_grammar_thread_later(self._matcher, c.kind, c.spec)
        except CompilerBusy as e:  # no thread could take it
            self._busy[key] = f"{BUSY}: {e}"
            return self._busy[key]
        return False

    def sweep(self) -> None:
        """Settle every compile that ended (or ran past its deadline), polled or not; forget
        the last sweep's busy refusals."""
        self._busy.clear()
        self._fresh.clear()
        self._vocab_busy = None
        job = self._vocab_job
        if job is not None and job.ready():
            self._vocab_job = None
            try:
                self._vocab = job.outcome()
            except Exception as e:  # noqa: BLE001 - a tokenizer that cannot load: every grammar waits on it
                self._vocab_busy = f"{BUSY}: the grammar vocabulary could not be built: {e}"
        for key, pending in list(self._pending.items()):
            if pending.ready():
                del self._pending[key]
                self._settle(key, pending)

    def compiled(self, c: Constraint) -> llguidance.LLMatcher:
        """The pristine matcher of `c`, waiting for its compile if it is not done; ValueError
        if it cannot compile against this vocabulary."""
        key = (c.kind, c.spec)
        while True:
            state = self.poll(c)
            if state is True:
                if key in self._compiled:
                    self._compiled.move_to_end(key)
                    return self._compiled[key]
                return self._fresh[key]
            if isinstance(state, str):
                raise ValueError(f"the {c.kind.value} constraint {state}")
            job = self._pending.get(key) or self._vocab_job
            if job is not None:
                try:
                    job.wait()
                except Exception:  # noqa: BLE001 - the sweep records it
                    pass
            self.sweep()

    def _start_vocab(self) -> bool | str:
        if self._vocab_busy is not None:
            return self._vocab_busy
        if self._vocab_job is None:
            try:
                self._vocab_job = on_grammar_thread_later(
                    self._make_vocab, timeout_s=VOCAB_TIMEOUT_S
                )
            except CompilerBusy as e:
                self._vocab_busy = f"{BUSY}: {e}"
                return self._vocab_busy
        return False

    def _matcher(self, kind: ConstraintKind, spec: str) -> llguidance.LLMatcher:
        """A pristine matcher of (kind, spec) (on the grammar thread, the vocabulary built)."""
        if self._vocab is None:
            raise RuntimeError("a grammar compiled before its vocabulary was built")
        source = grammar_source(kind, spec, self._to_lark)
        return llguidance.LLMatcher(self._vocab, source, log_level=0)

    def _settle(self, key: Key, pending: Pending[llguidance.LLMatcher]) -> None:
        try:
            m = pending.outcome()
        except CompilerBusy as e:  # it never started: not the constraint's fault
            self._busy[key] = f"{BUSY}: {e}"
            return
        except CompileTimeout as e:  # its own run passed the bound (queueing is not counted)
            why = str(e)
        except (ValueError, TypeError, RecursionError) as e:  # grammar_source's
            why = str(e) or type(e).__name__
        except Exception as e:  # noqa: BLE001 - anything else is the server's, not the spec's
            self._busy[key] = f"{BUSY}: {type(e).__name__}: {e}"
            return
        else:
            if not m.is_error():
                self.compiles += 1
                self._fresh[key] = m
                _remember(self._compiled, key, m, self._cache_size)
                return
            why = m.get_error()
        _remember(self._refused, key, f"does not compile: {why}", self._cache_size)


def _remember(cache: OrderedDict[Key, V], key: Key, value: V, size: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    if len(cache) > size:
        cache.popitem(last=False)
