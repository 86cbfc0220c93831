"""The constraint threads: where an event loop has its output constraints built.

A Constraint is checked as it is built: its `__post_init__` compiles it on the grammar thread
and waits (protocol/constraint.py, protocol/grammar_thread.py: up to COMPILE_TIMEOUT_S, twice
that when the compiler was busy). So no Constraint exists unchecked, and no event loop builds
one, or decodes a body holding one: a loop that did would stall every other request it serves
(streams, /health) for as long as a slow spec takes. The loop parses what is cheap (the front
end's fields into an `AskedConstraint`: frontend/structured.py; a worker's /generate body
names one or not) and hands the building to these threads with one `await`.

- **Threads of their own**, not the tokenizer's (frontend/prompts.py): requests queued behind
  slow compiles must not hold up others' tokenizing. CHECK_THREADS daemons (a
  TokenizerPool: a stopping server does not wait for them; a call whose client left before a
  thread took it never runs), started on first use, as most servers never see a constraint.
  The compiles themselves still run one at a time on the grammar thread; these only wait.
- **Bounded.** A call waits at most CHECK_TIMEOUT_S, which covers the grammar thread's own
  bounds and a short queue here; past it the constraint is refused as not compiled, the
  compiler being busy (InvalidParams, a 400 naming the field, as CompilerBusy is). A call
  already running when its wait ends finishes within the grammar thread's bounds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from pdserve.frontend.structured import AskedConstraint, build_constraint
from pdserve.frontend.tokenizer_pool import TokenizerPool
from pdserve.protocol.constraint import Constraint
from pdserve.protocol.grammar_thread import COMPILE_TIMEOUT_S
from pdserve.protocol.invalid_params import InvalidParams

CHECK_THREADS = 8  # constraints built at once; the rest wait their turn here
CHECK_TIMEOUT_S = 2 * COMPILE_TIMEOUT_S + 5.0  # one call, its queue wait included
A = TypeVar("A")
T = TypeVar("T")


class ConstraintThreads:
    """Builds Constraints, and decodes bodies that hold one, off the event loop."""

    def __init__(self, threads: int = CHECK_THREADS) -> None:
        self._threads = threads
        self._pool: TokenizerPool | None = None

    async def build(self, asked: AskedConstraint) -> Constraint:
        """`asked` checked and compiled; InvalidParams naming its field if it does not compile,
        took too long or was not compiled in time."""
        try:
            return await self.run(build_constraint, asked)
        except _NotInTime as e:
            raise asked.refusal(e) from None

    async def run(self, fn: Callable[[A], T], arg: A) -> T:
        """`fn(arg)` on a constraint thread, its result or its exception; InvalidParams naming
        `constraint` if it did not finish within CHECK_TIMEOUT_S."""
        if self._pool is None:
            self._pool = TokenizerPool(self._threads, name="constraint")
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                return await self._pool.run(fn, arg)
        except TimeoutError:
            raise _NotInTime(
                f"the constraint was not compiled within {CHECK_TIMEOUT_S:g}s (the grammar "
                "compiler is busy with others); try again",
                "constraint",
            ) from None

    def close(self) -> None:
        """Stop the threads (what is running finishes; what waits is dropped)."""
        if self._pool is not None:
            self._pool.close()


class _NotInTime(InvalidParams):
    """A call that did not finish within CHECK_TIMEOUT_S (the server's trouble, like
    CompilerBusy, which is also answered as InvalidParams)."""
