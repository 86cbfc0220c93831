"""Shared output streams: one long `POST /outputs` per router, carrying every request it sent.

Why: with one `/generate` stream per request, the worker's event loop wakes one handler and
makes one socket write per request per engine step, and the router reads as many sockets. At
concurrency 32 that is tens of thousands of chunks a second; the worker's loop shares the GIL
with the engine thread and the router's loop saturates, so tokens merge into fewer, later
chunks (docs/architecture.md §Streaming path). Through a channel each burst of engine outputs
is one write on the worker and one read on the router, whatever the number of requests.

The protocol (worker/http/api.py):
    POST /outputs  {"channel": ID}               -> NDJSON: RequestOutput lines of any of the
                                                    channel's requests, for as long as it lasts
    POST /generate {..., "channel": ID}          -> {"ok": true} once the engine has it; its
                                                    outputs go to the channel
Rules:
* a request's outputs leave in order on its channel only, and its last one carries a
  finish_reason: the engine's, or an error this module writes when no finish came within the
  request's deadline plus STREAM_GRACE_S, or when the worker stops with it unfinished;
* the channel's end (the router closed it, the connection broke) aborts every request it still
  carries on the engine: nobody is left to read their tokens;
* a stopping worker ends each channel once it carries nothing (`stop`), so the drain is not
  held up by an idle stream; `/generate` naming a channel that is gone (503 `channel_closed`:
  the router opens a new one), arriving while the worker stops (503 `shutting_down`) or past
  MAX_LIVE requests (503 `worker_full`) never reaches the engine, so the router may send it
  elsewhere;
* a channel with nothing to say for CHANNEL_HEARTBEAT_S writes a blank line, so the router can
  tell a quiet stream from a dead one (CHANNEL_SILENCE_S).

Everything here runs on the worker's event loop; outputs arrive through `Handoff`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from aiohttp import web

from pdserve.protocol.outputs import RequestOutput, encode_lines
from pdserve.runtime.timing import CHANNEL_HEARTBEAT_S
from pdserve.server.output_stream import merge_runs

MAX_CHANNELS = 256  # open channels per worker: one per router process, with room to spare
# Requests live on a worker's channels at most: what the connection limit bounded when each
# request had a stream of its own (a router sends at most its --max-queue, 4,096 by default).
MAX_LIVE = 8192
TIMED_OUT = "worker timed out waiting for its engine"


class ChannelError(Exception):
    """Why a channel cannot be opened or take a request: (status, message, code)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def encode_burst(outs: Sequence[RequestOutput]) -> bytes:
    """Outputs of many requests as NDJSON, each request's merged into as few lines as its
    finishes allow (`merge_runs`), requests in the order they first appear."""
    if len({o.request_id for o in outs}) == len(outs):  # the common case: one output each
        return encode_lines(outs)
    runs = by_request(outs).values()
    return encode_lines([m for run in runs for m in merge_runs(run)])


def by_request(outs: Sequence[RequestOutput]) -> dict[str, list[RequestOutput]]:
    """Each request's outputs in order, requests in the order they first appear."""
    runs: dict[str, list[RequestOutput]] = {}
    for o in outs:
        run = runs.get(o.request_id)
        if run is None:
            runs[o.request_id] = [o]
        else:
            run.append(o)
    return runs


class Channel:
    """One router's output stream. `abort(request_id)` tells the engine to drop a request."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, channel_id: str, abort: Callable[[str], None]
    ) -> None:
        self.id = channel_id
        self._loop = loop
        self._abort = abort
        self._live: dict[str, asyncio.TimerHandle] = {}  # request id -> its deadline's timer
        self._pending: list[RequestOutput] = []
        self._waiter: asyncio.Future[None] | None = None
        self._ending = False  # end the stream once no request is live
        self._beat_due = False
        self._beat = loop.call_later(CHANNEL_HEARTBEAT_S, self._heartbeat)
        self.closed = False

    def __len__(self) -> int:
        return len(self._live)

    @property
    def ending(self) -> bool:
        """It takes no more requests and ends once those it carries have finished."""
        return self._ending

    def add(self, request_id: str, wait_s: float) -> None:
        """Carry `request_id`'s outputs; fail it if its finish has not come within `wait_s`."""
        if self.closed or self._ending:
            raise ChannelError(503, f"output channel {self.id!r} is closed", "channel_closed")
        if request_id in self._live:
            raise ChannelError(
                409, f"request {request_id!r} is already live on this channel", "duplicate_id"
            )
        self._live[request_id] = self._loop.call_later(wait_s, self._expire, request_id)

    def discard(self, request_id: str) -> None:
        """Stop carrying a request the engine never took."""
        timer = self._live.pop(request_id, None)
        if timer is not None:
            timer.cancel()
        self._wake()

    def put(self, out: RequestOutput) -> None:
        """An engine output (on the loop, via Handoff). Outputs of a request already ended here
        (expired, failed) are dropped: its last line has gone."""
        timer = self._live.get(out.request_id)
        if timer is None:
            return
        if out.finish_reason is not None:
            timer.cancel()
            del self._live[out.request_id]
        self._pending.append(out)
        self._wake()

    def stop(self) -> None:
        """Take no more requests; end the stream once those carried have finished."""
        self._ending = True
        self._wake()

    def fail_all(self, why: str) -> int:
        """End every request still carried with an error line (and abort it); then the stream
        ends. Returns how many there were."""
        rids = list(self._live)
        for rid in rids:
            self._fail(rid, why)
        self.stop()
        return len(rids)

    async def serve(self, resp: web.StreamResponse) -> None:
        """Write outputs to `resp` (prepared) until the channel is stopped and empty; a write
        that fails raises (the connection is gone). Whatever is still carried then is aborted
        (`close`)."""
        try:
            while True:
                while not self._pending and not self._beat_due:
                    if self._ending and not self._live:
                        await resp.write_eof()
                        return
                    self._waiter = self._loop.create_future()
                    try:
                        await self._waiter
                    finally:
                        self._waiter = None
                self._beat_due = False
                if not self._pending:
                    await resp.write(b"\n")
                    continue
                outs, self._pending = self._pending, []
                await resp.write(encode_burst(outs))
        finally:
            self.close()

    def close(self) -> None:
        """The stream is over: abort every request still carried (idempotent)."""
        self.closed = True
        self._beat.cancel()
        live, self._live = self._live, {}
        for rid, timer in live.items():
            timer.cancel()
            self._abort(rid)
        self._pending.clear()
        self._wake()

    def _heartbeat(self) -> None:
        self._beat_due = True
        self._wake()
        self._beat = self._loop.call_later(CHANNEL_HEARTBEAT_S, self._heartbeat)

    def _expire(self, request_id: str) -> None:
        if request_id in self._live:
            self._fail(request_id, TIMED_OUT)

    def _fail(self, request_id: str, why: str) -> None:
        self._live.pop(request_id).cancel()
        self._abort(request_id)
        self._pending.append(RequestOutput(request_id, (), (), "error", why))
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


class Channels:
    """A worker's open channels, by id."""

    def __init__(self, limit: int = MAX_CHANNELS) -> None:
        self.limit = limit
        self._open: dict[str, Channel] = {}
        self.stopping = False

    def __len__(self) -> int:
        return len(self._open)

    def open(
        self, loop: asyncio.AbstractEventLoop, channel_id: str, abort: Callable[[str], None]
    ) -> Channel:
        if self.stopping:
            raise ChannelError(503, "the worker is shutting down", "shutting_down")
        if channel_id in self._open:
            raise ChannelError(
                409, f"output channel {channel_id!r} is already open", "duplicate_id"
            )
        if len(self._open) >= self.limit:
            raise ChannelError(
                503,
                f"the worker has {self.limit} output channels open already",
                "too_many_channels",
            )
        ch = self._open[channel_id] = Channel(loop, channel_id, abort)
        return ch

    def admit(self, channel_id: str, request_id: str, wait_s: float) -> Channel:
        """The open channel, now carrying `request_id` (`Channel.add`); ChannelError 503 when
        it is gone, the worker is stopping or full, 409 for a request id it carries already."""
        ch = self._open.get(channel_id)
        if self.stopping:
            raise ChannelError(503, "the worker is shutting down", "shutting_down")
        if ch is None or ch.closed:
            raise ChannelError(
                503, f"output channel {channel_id!r} is not open here", "channel_closed"
            )
        if sum(len(c) for c in self._open.values()) >= MAX_LIVE:
            raise ChannelError(
                503, f"the worker carries {MAX_LIVE} requests already", "worker_full"
            )
        ch.add(request_id, wait_s)
        return ch

    def snapshot(self) -> list[dict[str, object]]:
        """For /debug/state: each open channel, the requests it carries and whether it ends."""
        return [
            {"id": ch.id, "requests": len(ch), "ending": ch.ending} for ch in self._open.values()
        ]

    def remove(self, ch: Channel) -> None:
        if self._open.get(ch.id) is ch:
            del self._open[ch.id]

    def stop(self) -> None:
        """The worker is stopping: no new channel or request; each ends once empty."""
        self.stopping = True
        for ch in list(self._open.values()):
            ch.stop()

    def fail_all(self, why: str) -> int:
        return sum(ch.fail_all(why) for ch in list(self._open.values()))
