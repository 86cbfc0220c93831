"""One HTTP connection of a pdserve server, with the limits aiohttp does not enforce itself.

A connection is in one phase at a time, and each phase has its own bound:

    IDLE  connected, or its last response ended: the first byte of a request must arrive
          within `idle_timeout_s` (the keep-alive timeout), else the connection is closed
    HEAD  a request's first byte came: the whole head must arrive within `header_timeout_s`
          of it (a slowloris client trickling header bytes is closed then)
    BUSY  a handler runs (marked by `Listener.middleware`): no timer; the body has its own
          timeout (`read_json`), and a response the client stops reading is bounded below
    REFUSED  opened past the connection cap: answered 503 at once, closed soon after

In every phase but REFUSED, a client that stops reading its response (the transport's buffer
stays over its high-water mark) is cut off after `write_stall_s`; so is one whose last
response is still unsent `write_stall_s` after the handler ended.

aiohttp answers a malformed HTTP message (bad request line, a header line over 8 KiB, an
invalid Content-Length) before any middleware runs, as a plain-text 400 with an ERROR
traceback in the log. Here that answer is an OpenAI-style JSON body, and a client's malformed
message is one INFO line: it is the client's fault, not the server's.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web
from aiohttp.web_request import BaseRequest

from pdserve.runtime.timing import REFUSE_LINGER_S, RETRY_AFTER_S
from pdserve.server.api_error import ApiError
from pdserve.server.errors import INTERNAL_ERROR

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    IDLE = "idle"
    HEAD = "head"
    BUSY = "busy"
    REFUSED = "refused"


class Owner(Protocol):
    """What a connection needs from its listener (pdserve.server.listener.Listener)."""

    idle_timeout_s: float
    header_timeout_s: float
    write_stall_s: float
    max_connections: int

    def full(self) -> bool: ...
    def opened(self, conn: Connection) -> None: ...
    def closed(self, conn: Connection) -> None: ...
    def count(self, event: str) -> None: ...


class Connection(web.RequestHandler):
    """aiohttp's per-connection protocol, with the phases above."""

    def __init__(self, owner: Owner, manager: web.Server, loop: asyncio.AbstractEventLoop) -> None:
        # No access log, as aiohttp's AppRunner(access_log=None) (its stub wants a Logger).
        # No inflation by aiohttp's parser: server/body.py inflates bodies, bounded (aiohttp's
        # own runners get the same from the app's handler_args, `body.app_args`).
        super().__init__(
            manager,
            loop=loop,
            access_log=None,  # type: ignore[arg-type]
            auto_decompress=False,
        )
        self._owner = owner
        self.phase = Phase.IDLE
        self._timer: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._flush_extended = False  # the IDLE timer waited once for an unsent response
        self.peer = "?"
        self._lost: list[Callable[[], None]] = []  # run once, when the connection is lost

    @property
    def busy(self) -> bool:
        return self.phase is Phase.BUSY

    # -- asyncio's protocol calls ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if self._owner.full():
            self._refuse(transport)
            return
        self._owner.opened(self)
        super().connection_made(transport)
        self._arm(self._owner.idle_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self.phase is Phase.REFUSED:
            return  # read and dropped: the answer went out already
        if self.phase is Phase.IDLE and data:
            self.phase = Phase.HEAD
            self._arm(self._owner.header_timeout_s)
        super().data_received(data)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._stall = self._loop.call_later(self._owner.write_stall_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def connection_lost(self, exc: BaseException | None) -> None:
        for timer in (self._timer, self._stall):
            if timer is not None:
                timer.cancel()
        self._timer = self._stall = None
        watchers, self._lost = self._lost, []
        for callback in watchers:
            try:
                callback()
            except Exception:  # noqa: BLE001 - one watcher's bug must not skip the others
                log.exception("a disconnect watcher of %s failed", self.peer)
        if self.phase is Phase.REFUSED:
            self._owner.count("refused_closed")
            return  # aiohttp never saw this connection
        self._owner.closed(self)
        super().connection_lost(exc)

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run `callback` once when this connection is lost (at once if it is already);
        returns the call that stops watching."""
        transport = self.transport
        if transport is None or transport.is_closing():
            callback()
            return _nothing
        self._lost.append(callback)

        def unwatch() -> None:
            if callback in self._lost:
                self._lost.remove(callback)

        return unwatch

    # -- called by Listener.middleware ----------------------------------------------------------
    def request_started(self) -> None:
        self.phase = Phase.BUSY
        self._flush_extended = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def request_finished(self) -> None:
        if self.phase is Phase.BUSY:
            self.phase = Phase.IDLE
            self._arm(self._owner.idle_timeout_s)

    # -- timers ---------------------------------------------------------------------------------
    def _arm(self, delay_s: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(delay_s, self._expired)

    def _expired(self) -> None:
        self._timer = None
        transport = self.transport
        if transport is None or self.phase in (Phase.BUSY, Phase.REFUSED):
            return
        if transport.get_write_buffer_size() and not self._flush_extended:
            # The handler ended but its response is still being sent: give it the write
            # bound before calling the connection idle.
            self._flush_extended = True
            self._arm(self._owner.write_stall_s)
            return
        if self.phase is Phase.HEAD:
            self._owner.count("header_timeouts")
            log.info(
                "closed a connection from %s: no complete request head %.0fs after its first byte",
                self.peer,
                self._owner.header_timeout_s,
            )
        else:
            self._owner.count("idle_closed")
        self._close_now()

    def _stalled(self) -> None:
        self._stall = None
        self._owner.count("write_stalls")
        log.info(
            "closed a connection from %s: it read none of its response for %.0fs",
            self.peer,
            self._owner.write_stall_s,
        )
        self._close_now()

    def _close_now(self) -> None:
        transport = self.transport
        if transport is not None and transport.get_write_buffer_size():
            transport.abort()  # close() would wait for a client that does not read
        self.force_close()

    # -- past the cap ---------------------------------------------------------------------------
    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        """Answer 503 before reading anything, half-close, drop what the client still sends,
        close within REFUSE_LINGER_S. A slowloris past the cap costs no more than that."""
        assert isinstance(transport, asyncio.WriteTransport)
        self.phase = Phase.REFUSED
        self._owner.count("refused")
        err = ApiError(
            503,
            f"the server has {self._owner.max_connections} connections open, its limit; "
            f"retry after {RETRY_AFTER_S}s",
            type_="server_error",
            code="too_many_connections",
        )
        body = json.dumps(err.body()).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            f"Retry-After: {RETRY_AFTER_S}\r\n"
            "Connection: close\r\n\r\n"
        )
        transport.write(head.encode() + body)
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = self._loop.call_later(REFUSE_LINGER_S, transport.close)

    # -- aiohttp's answer to a malformed message ------------------------------------------------
    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
            text = INTERNAL_ERROR
        else:
            text = _first_line(message or (str(exc) if exc else "") or "bad request")
            log.info("bad HTTP from %s: %d %s", request.remote, status, text)
        if request.writer.output_size > 0:
            raise ConnectionError("the response had started; no error can be sent after it")
        kind = "server_error" if status >= 500 else "invalid_request_error"
        body: dict[str, Any] = ApiError(status, text, type_=kind, code="bad_http").body()
        resp = web.json_response(body, status=status)
        resp.force_close()
        return resp


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _nothing() -> None:
    pass


def on_disconnect(request: web.BaseRequest, callback: Callable[[], None]) -> Callable[[], None]:
    """Run `callback` once when `request`'s client goes away, whatever its handler is doing
    then (LESSONS #17); returns the call that stops watching. A request served by another
    protocol than Connection (aiohttp's own, in some tests) is checked once, now."""
    protocol = request.protocol
    if isinstance(protocol, Connection):
        return protocol.watch(callback)
    transport = request.transport
    if transport is None or transport.is_closing():
        callback()
    return _nothing
