"""The listening side of every pdserve HTTP server (co-located, workers, router).

* **Bound before the model loads.** `bind` takes the port first, so a busy port is one clear
  line (`bind_error`) and exit status 2 within a second, not a traceback after the model
  load. It listens at once too: with SO_REUSEADDR (needed to restart over connections in
  TIME_WAIT) Linux lets a second process bind a port that is bound but not listening. A
  client that connects while the model loads waits in the backlog until the server is up.
* **A cap on open connections**, below the descriptor limit (`connection_cap`): past it a
  new connection is answered 503 with `Retry-After` at once and closed (server/connection.py),
  the way uvicorn's `--limit-concurrency` answers vLLM's and SGLang's users. Requests past
  `--max-queue` on admitted connections get 429 (server/admission.py).
* **Timeouts per connection**: idle (keep-alive, 5 s as in vLLM and SGLang), request head
  (10 s from its first byte), and a response the client stops reading (30 s): `HttpLimits`,
  enforced by `Connection`.
* **accept() at the descriptor limit backs off.** Python 3.11's event loop, on EMFILE, stops
  watching the socket for a second but first retries accept() up to `backlog` times in the
  same tick, logging a traceback each time: a flood of connections at the limit once wrote
  230 MB of log in a minute. `AcceptSocket` answers those retries "nothing to accept", and
  `quiet_accept_errors` logs one line per back-off without a traceback.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import time
from collections import Counter
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pdserve.config import HttpLimits as HttpLimits
from pdserve.runtime.timing import ACCEPT_BACKOFF_S, HANDLERS_STOP_S
from pdserve.server.connection import Connection

log = logging.getLogger(__name__)

BACKLOG = 1024
MAX_CONNECTIONS = 8192  # the default cap where descriptors allow it (above --max-queue's 4096)
MIN_CONNECTIONS = 16
FD_RESERVE = 256  # descriptors kept for everything but client connections (files, ZMQ, pipes)
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's context message


def connection_cap(fds_per_connection: int) -> int:
    """MAX_CONNECTIONS, or fewer so that connections cannot use up the descriptor limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    room = (soft - FD_RESERVE) // fds_per_connection
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, room))


class AcceptSocket(socket.socket):
    """A listening socket whose accept() says "nothing to accept" for a moment after it ran
    out of descriptors (see the module header)."""

    quiet_until = 0.0

    def accept(self) -> tuple[socket.socket, Any]:
        if time.monotonic() < self.quiet_until:
            raise BlockingIOError(errno.EAGAIN, "backing off: out of descriptors")
        try:
            return super().accept()
        except OSError as e:
            if e.errno in RESOURCE_ERRNOS:
                # A little under asyncio's delay, so its retry finds us listening again.
                self.quiet_until = time.monotonic() + 0.9 * ACCEPT_BACKOFF_S
            raise


def bind(
    host: str, port: int, *, reuse_port: bool = False, listen: bool = True
) -> list[socket.socket]:
    """Listening sockets on every address of `host` on `port` (0: one free port for all).
    `reuse_port`: with SO_REUSEPORT, so that several processes of this user share the port
    (the kernel spreads connections over those listening); `listen` False: bound only, which
    holds the port without ever being handed a connection (router/pool.py). Raises OSError
    (see `bind_error`)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    seen: set[Any] = set()
    try:
        for family, kind, proto, _, addr in infos:
            if addr in seen:
                continue
            seen.add(addr)
            s = AcceptSocket(family, kind, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(socks) > 1:  # every address on the first one's free port
                addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
            s.bind(addr)
            if listen:
                s.listen(BACKLOG)
    except OSError:
        for bound in socks:
            bound.close()
        raise
    return socks


def bind_error(host: str, port: int, e: OSError, flag: str = "--port") -> str:
    """One line saying why `bind(host, port)` failed and what to do (`flag` sets the port)."""
    where = f"cannot listen on {host}:{port}"
    if isinstance(e, socket.gaierror):
        return f"{where}: cannot resolve {host!r} ({e.strerror})"
    if e.errno == errno.EADDRINUSE:
        return f"{where}: the port is in use (another server?); choose another with {flag}"
    if e.errno == errno.EACCES:
        return f"{where}: permission denied (ports below 1024 need privileges)"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"{where}: no such address on this machine; check --host"
    return f"{where}: {e.strerror or e}"


class Listener:
    """Serves an aiohttp runner on bound sockets with the limits above. `fds_per_connection`:
    2 for the router (a client connection and one to a worker per request), else 1."""

    def __init__(
        self,
        sockets: list[socket.socket],
        limits: HttpLimits | None = None,
        fds_per_connection: int = 1,
    ) -> None:
        if not sockets:
            raise ValueError("a listener needs at least one bound socket")
        limits = limits or HttpLimits()
        self.sockets = sockets
        self.port = int(sockets[0].getsockname()[1])
        self.max_connections = limits.max_connections or connection_cap(fds_per_connection)
        self.idle_timeout_s = limits.idle_timeout_s
        self.header_timeout_s = limits.header_timeout_s
        self.write_stall_s = limits.write_stall_s
        self.connections: set[Connection] = set()
        # accepted, refused, refused_closed, idle_closed, header_timeouts, write_stalls
        self.stats: Counter[str] = Counter()
        self._servers: list[asyncio.AbstractServer] = []
        self._refusals_logged = 0.0

    @property
    def busy(self) -> int:
        """Connections with a request in progress."""
        return sum(1 for c in self.connections if c.busy)

    # -- Owner, for Connection --------------------------------------------------------------
    def full(self) -> bool:
        return len(self.connections) >= self.max_connections

    def opened(self, conn: Connection) -> None:
        self.connections.add(conn)
        self.stats["accepted"] += 1

    def closed(self, conn: Connection) -> None:
        self.connections.discard(conn)

    def count(self, event: str) -> None:
        self.stats[event] += 1
        now = time.monotonic()
        if event == "refused" and now - self._refusals_logged >= 5.0:
            self._refusals_logged = now
            log.warning(
                "refusing connections past the limit of %d open (503); %d refused so far",
                self.max_connections,
                self.stats["refused"],
            )

    # -- serving ----------------------------------------------------------------------------
    def middleware(self) -> Middleware:
        """Marks a connection busy while its handler runs (outermost middleware)."""

        @web.middleware
        async def track(request: web.Request, handler: Handler) -> web.StreamResponse:
            conn = request.protocol
            if not isinstance(conn, Connection):
                return await handler(request)
            conn.request_started()
            try:
                return await handler(request)
            finally:
                conn.request_finished()

        return track

    async def serve(self, app: web.Application) -> web.AppRunner:
        """Set `app` up and serve it on every socket; the caller cleans the runner up. Handlers
        still running HANDLERS_STOP_S into that cleanup are cancelled."""
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=HANDLERS_STOP_S
        )
        await runner.setup()
        await self.start(runner)
        return runner

    async def start(self, runner: web.BaseRunner) -> None:
        """Listen and serve `runner` (set up already) on every socket."""
        server = runner.server
        if server is None:
            raise RuntimeError("call runner.setup() before Listener.start")
        loop = asyncio.get_running_loop()
        quiet_accept_errors(loop, self)

        def factory() -> Connection:
            return Connection(self, server, loop)

        for s in self.sockets:
            self._servers.append(await loop.create_server(factory, sock=s, backlog=BACKLOG))

    def stop_accepting(self) -> None:
        """Close the listening sockets; open connections live on (drain)."""
        for srv in self._servers:
            srv.close()

    def snapshot(self) -> dict[str, Any]:
        return {
            "open": len(self.connections),
            "busy": self.busy,
            "max_connections": self.max_connections,
            **dict(self.stats),
        }


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, listener: Listener) -> None:
    """Log asyncio's accept-at-the-limit error as one line, no traceback; pass on the rest."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if context.get("message") == ACCEPT_FAILED and isinstance(exc, OSError):
            log.warning(
                "cannot accept connections: %s (%d open, limit %d); retrying in %.0fs",
                exc.strerror or exc,
                len(listener.connections),
                listener.max_connections,
                ACCEPT_BACKOFF_S,
            )
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
