"""Request outputs from the engine thread (or the loop itself) to the asyncio handler streaming
them, in bursts: the per-token path of every server (docs/architecture.md §Streaming path).

* `Handoff` (one per event loop, `handoff(loop)`): `push(deliver, item)` from another thread
  queues the pair and schedules one drain on the loop only when none is pending, so an engine
  step that emits a token for each of 128 requests wakes the loop once, not 128 times (each
  `call_soon_threadsafe` writes the loop's self-pipe). The drain calls `deliver(item)` on the
  loop in push order. From the loop's own thread (the router's backend) it delivers at once.
* `OutputStream` (one per request): what the handler waits on. `put` appends; `take` returns
  everything that arrived since the last call, at least one output, so a handler that was
  busy writing (a slow client) catches up in one write. Its deadline is one timer for the
  whole stream, not one per wait.
* `merge(outputs)`: consecutive outputs of one request as one: the tokens, logprobs and
  prompt logprobs in order, the last one's finish. Exact for every consumer that reads an
  output as "these tokens came next", which is all of them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from pdserve.protocol.outputs import RequestOutput

Deliver = Callable[[Any], None]
T = TypeVar("T")
log = logging.getLogger(__name__)


class Handoff:
    """Items from any thread into one loop, one wake-up per burst."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weakly: the registry below is keyed weakly by the loop, and a strong reference from
        # its value would keep every loop (one per asyncio.run) alive forever.
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self._items: list[tuple[Deliver, Any]] = []
        self._scheduled = False
        self._draining = False  # a push made by a delivery waits behind the rest of its drain
        self._loop_thread: int | None = None  # known once the loop has drained (or now)
        try:
            if asyncio.get_running_loop() is loop:
                self._loop_thread = threading.get_ident()
        except RuntimeError:
            pass  # made off the loop; learned at the first drain

    def push(self, deliver: Deliver, item: Any) -> None:
        """`deliver(item)` on the loop, after every item pushed before it; safe from any
        thread. On the loop's own thread with nothing queued, at once."""
        on_loop = threading.get_ident() == self._loop_thread
        with self._lock:
            if on_loop and not self._scheduled and not self._draining:
                direct = True
            else:
                direct = False
                self._items.append((deliver, item))
                if self._scheduled:
                    return
                self._scheduled = True
        if direct:
            deliver(item)
            return
        try:
            loop = self._loop()
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nothing will drain, say so to the caller
            with self._lock:
                self._scheduled = False
            raise

    def _drain(self) -> None:
        self._loop_thread = threading.get_ident()
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        self._draining = True
        try:
            for deliver, item in items:
                try:
                    deliver(item)
                except Exception:  # noqa: BLE001 - one bad delivery must not lose the rest
                    log.exception("delivering a request output failed")
        finally:
            self._draining = False


_handoffs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Handoff] = (
    weakref.WeakKeyDictionary()
)
_handoffs_lock = threading.Lock()


def handoff(loop: asyncio.AbstractEventLoop) -> Handoff:
    """The loop's one Handoff."""
    with _handoffs_lock:
        h = _handoffs.get(loop)
        if h is None:
            h = _handoffs[loop] = Handoff(loop)
        return h


class StreamTimeout(Exception):
    """An OutputStream's deadline passed with nothing left to take."""


class OutputStream(Generic[T]):
    """One request's outputs (or a call's, tagged by choice), waited on by one task. Use on
    the loop's thread only."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """`deadline` on the loop's clock (`loop.time()`, i.e. time.monotonic)."""
        self._loop = loop
        self._pending: list[T] = []
        self._waiter: asyncio.Future[None] | None = None
        self.expired = False
        self._timer = loop.call_at(deadline, self._expire)

    def put(self, out: T) -> None:
        self._pending.append(out)
        self._wake()

    def _expire(self) -> None:
        self.expired = True
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def take(self) -> list[T]:
        """Every output not yet taken (at least one), oldest first; StreamTimeout once the
        deadline passed and nothing is left."""
        while not self._pending:
            if self.expired:
                raise StreamTimeout
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        out, self._pending = self._pending, []
        return out

    def close(self) -> None:
        """Cancel the deadline's timer (the stream is over)."""
        self._timer.cancel()


def merge(outs: Sequence[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one output (see the module doc)."""
    if len(outs) == 1:
        return outs[0]
    first, last = outs[0], outs[-1]
    return RequestOutput(
        first.request_id,
        tuple(t for o in outs for t in o.token_ids),
        tuple(lp for o in outs for lp in o.logprobs),
        last.finish_reason,
        last.error,
        max(o.num_prompt_tokens for o in outs),
        tuple(lp for o in outs for lp in o.prompt_logprobs),
    )


def merge_runs(outs: Sequence[RequestOutput]) -> list[RequestOutput]:
    """`outs` of one request, merged up to and including each output that carries a finish
    (nothing should follow one; if something does, it stays separate for the consumer to
    ignore)."""
    merged: list[RequestOutput] = []
    run: list[RequestOutput] = []
    for o in outs:
        run.append(o)
        if o.finish_reason is not None:
            merged.append(merge(run))
            run = []
    if run:
        merged.append(merge(run))
    return merged
