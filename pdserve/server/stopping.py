"""How a pdserve server stops: graceful on the first signal, at once on the second.

The first SIGINT (Ctrl-C) or SIGTERM, or a fatal error, asks for a graceful stop: the server
stops accepting, lets running requests finish for at most its drain time, then ends the rest
itself. A second signal at any point means "now": every wait below returns at once and the
process exits with 128 + the signal's number, as a shell reports a signal. Every wait here is
bounded, and is cut short by the second signal.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pdserve.runtime.timing import STOP_POLL_S

log = logging.getLogger(__name__)

T = TypeVar("T")


class Stop:
    def __init__(self) -> None:
        self.requested = asyncio.Event()  # stop gracefully
        self.forced = asyncio.Event()  # stop now
        self.reason = ""
        self.forced_by: int | None = None  # the signal that forced it

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def request(self, reason: str) -> None:
        """Ask for a graceful stop (on the loop's thread)."""
        if not self.requested.is_set():
            self.reason = reason
            self.requested.set()

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if not self.requested.is_set():
            self.request(name)
            return
        if not self.forced.is_set():
            self.forced_by = sig
            self.forced.set()
            log.warning("%s again: stopping now, without waiting for running requests", name)

    @property
    def exit_code(self) -> int | None:
        """128 + the forcing signal's number once forced, else None."""
        return None if self.forced_by is None else 128 + self.forced_by

    async def drain(self, idle: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until `idle()` holds; False if `timeout_s` passed or the stop was forced."""
        deadline = time.monotonic() + timeout_s
        while not idle():
            left = deadline - time.monotonic()
            if self.forced.is_set() or left <= 0:
                return False
            try:
                async with asyncio.timeout(min(STOP_POLL_S, left)):
                    await self.forced.wait()
            except TimeoutError:
                pass
        return True

    async def unless_forced(self, aw: Awaitable[T], timeout_s: float) -> T | None:
        """`aw`'s result; None if it takes longer than `timeout_s` or the stop is forced first
        (it is then cancelled)."""
        task = asyncio.ensure_future(aw)
        forced = asyncio.ensure_future(self.forced.wait())
        try:
            done, _ = await asyncio.wait(
                {task, forced}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            forced.cancel()
        if task in done:
            return task.result()
        task.cancel()
        return None


async def in_thread(fn: Callable[[], T]) -> T:
    """`fn()` on a daemon thread of its own, so that a forced stop need not wait for it (the
    loop's default executor is joined when asyncio.run ends)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            error = e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody waits for the answer any more
            pass

    threading.Thread(target=run, name="stopping", daemon=True).start()
    return await fut
