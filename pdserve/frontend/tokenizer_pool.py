"""The front end's tokenizer threads: a few daemon threads that run tokenizer calls for the
event loop, one call at a time each.

Not a ThreadPoolExecutor, for two reasons (LESSONS #19):
* the interpreter joins an executor's threads at exit, so a process told to stop would wait
  for a tokenization in flight to finish (the `tokenizers` call cannot be interrupted); these
  threads are daemons: a stopping server exits, and the call dies with it;
* a call whose awaiting task is cancelled before a thread takes it (its client left) is
  skipped, checked on the thread through a flag the loop sets, not through the asyncio
  future, which only the loop may touch.
A call that raises hands its exception to the awaiting task. The threads do nothing but run
calls; they hold no state between calls and need no supervision beyond that: a call that
never returns costs its thread, and `TOKENIZE_TIMEOUT_S` (frontend/api.py) answers its
request.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

A = TypeVar("A")
T = TypeVar("T")


@dataclass
class _Call(Generic[A, T]):
    fn: Callable[[A], T]
    arg: A
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[T]
    dropped: threading.Event = field(default_factory=threading.Event)  # cancelled: skip it


class TokenizerPool:
    def __init__(self, threads: int, name: str = "tokenize") -> None:
        self._calls: queue.SimpleQueue[_Call[Any, Any] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()
        self.closed = False

    async def run(self, fn: Callable[[A], T], arg: A) -> T:
        """`fn(arg)` on a pool thread; cancelling the awaiting task drops the call if no
        thread has taken it yet."""
        if self.closed:
            raise RuntimeError("the tokenizer pool is closed")
        loop = asyncio.get_running_loop()
        call: _Call[A, T] = _Call(fn, arg, loop, loop.create_future())
        call.future.add_done_callback(lambda f: _drop_if_cancelled(f, call.dropped))
        self._calls.put(call)
        return await call.future

    def queued(self) -> int:
        """Calls waiting for a thread (those dropped included, until a thread skips them)."""
        return self._calls.qsize()

    def close(self) -> None:
        """No new calls; what is running finishes, what waits is cancelled, and the threads
        end."""
        self.closed = True
        for _ in self._threads:
            self._calls.put(None)

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            if call.dropped.is_set():
                continue
            if self.closed:
                _settle_soon(call, cancel=True)
                continue
            try:
                result, error = call.fn(call.arg), None
            except BaseException as e:  # noqa: BLE001 - the awaiting task gets it
                result, error = None, e
            _settle_soon(call, result=result, error=error)


def _drop_if_cancelled(future: asyncio.Future[Any], dropped: threading.Event) -> None:
    if future.cancelled():
        dropped.set()


def _settle_soon(
    call: _Call[Any, Any],
    result: Any = None,
    error: BaseException | None = None,
    cancel: bool = False,
) -> None:
    """Settle the call's future on its loop (only the loop may touch it)."""
    try:
        if cancel:
            call.loop.call_soon_threadsafe(call.future.cancel)
        else:
            call.loop.call_soon_threadsafe(_settle, call.future, result, error)
    except RuntimeError:  # the loop is closed: nobody waits any more
        pass


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled while it ran
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
