"""The router's end of a worker's shared output stream (the worker's end: worker/http/channels.py).

One `WorkerChannel` per worker: a task holds the worker's `POST /outputs` open and hands each
output line to the request it names. A request registers its receiver before its `/generate`
leaves (its outputs may overtake the answer), and unregisters when its attempt ends.

The channel opens on the first request that needs it; requests arriving meanwhile wait for
that one opening (bounded: the client's open timeout, and a belt here). When the stream ends,
breaks or stays silent past CHANNEL_SILENCE_S (the worker writes a blank line every
CHANNEL_HEARTBEAT_S), every request it carried hears `broken(what)` once (the worker aborts
them all at the stream's end), and the next request opens a new channel under a new id.

A request the router stopped listening to before its finish (aborted, timed out) was aborted
on the worker with one POST. If its outputs still arrive ORPHAN_ABORT_AFTER_S later, that POST
was lost or overtook the /generate it aborts: `on_orphan` aborts it again, at most once per
that interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.protocol.outputs import RequestOutput
from pdserve.router.client import WorkerClient, WorkerError
from pdserve.runtime.timing import CHANNEL_SILENCE_S, ORPHAN_ABORT_AFTER_S

log = logging.getLogger(__name__)

MAX_ORPHANS = 4096  # requests a stream remembers as no longer listened to (oldest out first)


@dataclass
class Receiver:
    output: Callable[[RequestOutput], None]  # each output, in order, the last with its finish
    broken: Callable[[str], None]  # the stream ended or broke before the finish came


@dataclass
class _Stream:
    """One opening of the channel: its id once open, and who listens on it."""

    opening: asyncio.Future[str]  # the id, once the worker has answered
    task: asyncio.Task[None] | None = None
    id: str | None = None
    receivers: dict[str, Receiver] = field(default_factory=dict)
    orphans: dict[str, float] = field(default_factory=dict)  # request id -> last aborted


class WorkerChannel:
    """One worker's output channel, as the router sees it. `on_orphan(request_id)` aborts a
    request on the worker again (see the module doc)."""

    def __init__(
        self,
        client: WorkerClient,
        open_timeout_s: float,
        on_orphan: Callable[[str], None] = lambda rid: None,
        silence_s: float = CHANNEL_SILENCE_S,
    ) -> None:
        self.client = client
        self.open_timeout_s = open_timeout_s
        self.silence_s = silence_s
        self.on_orphan = on_orphan
        self._stream: _Stream | None = None  # the current one
        self.closed = False  # closed for good (the router stops): ready() refuses
        self.opened = 0  # channels opened so far (for tests and the log)

    @property
    def id(self) -> str | None:
        """The open channel's id."""
        return self._stream.id if self._stream is not None else None

    def __len__(self) -> int:
        return len(self._stream.receivers) if self._stream is not None else 0

    def snapshot(self) -> dict[str, object]:
        """For /debug/cluster: the open channel's id, the requests on it, openings so far."""
        stream = self._stream
        return {
            "id": stream.id if stream is not None else None,
            "requests": len(self),
            "orphans": len(stream.orphans) if stream is not None else 0,
            "opened": self.opened,
        }

    async def ready(self) -> str:
        """The open channel's id, opening one first if none is; WorkerError if it cannot
        (connect=True: the worker never saw anything, so the request may go elsewhere)."""
        if self.closed:
            raise WorkerError(self.client.url, "the router is closing its output streams")
        stream = self._stream
        if stream is None:
            loop = asyncio.get_running_loop()
            stream = self._stream = _Stream(loop.create_future())
            # Read here, so that an opening every waiter gave up on logs nothing.
            stream.opening.add_done_callback(lambda f: f.cancelled() or f.exception())
            stream.task = loop.create_task(self._run(stream), name=f"outputs {self.client.url}")
        # Shielded: a request cancelled while it waits must not cancel the opening. Bounded by
        # the client (`outputs`: open_timeout_s) and by the caller's deadline.
        return await asyncio.shield(stream.opening)

    def register(self, channel_id: str, request_id: str, receiver: Receiver) -> bool:
        """Send `request_id`'s outputs to `receiver`; False if channel `channel_id` (what
        `ready` said) has ended since."""
        stream = self._stream
        if stream is None or stream.id != channel_id:
            return False
        stream.orphans.pop(request_id, None)
        stream.receivers[request_id] = receiver
        return True

    def unregister(self, request_id: str) -> None:
        """The request's attempt is over. If it had not finished, it was (or is being)
        aborted: its outputs that still come are orphans."""
        stream = self._stream
        if stream is not None and stream.receivers.pop(request_id, None) is not None:
            stream.orphans[request_id] = time.monotonic()
            if len(stream.orphans) > MAX_ORPHANS:
                del stream.orphans[next(iter(stream.orphans))]

    def discard(self, request_id: str) -> None:
        """Forget a request the worker never took (nothing of it will come)."""
        if self._stream is not None:
            self._stream.receivers.pop(request_id, None)

    def reset(self, channel_id: str) -> None:
        """The worker says channel `channel_id` is not open there: drop our end of it (its
        requests hear `broken`), so that the next request opens a new one."""
        stream = self._stream
        if stream is not None and stream.id == channel_id and stream.task is not None:
            self._stream = None
            stream.task.cancel()

    async def close(self) -> None:
        """Close the stream for good (the worker aborts what it still carries); receivers hear
        `broken`."""
        self.closed = True
        stream, self._stream = self._stream, None
        if stream is not None and stream.task is not None and not stream.task.done():
            stream.task.cancel()
            await asyncio.wait([stream.task], timeout=1.0)

    def _deliver(self, stream: _Stream, outs: list[RequestOutput]) -> None:
        for out in outs:
            r = stream.receivers.get(out.request_id)
            if r is None:
                self._orphan(stream, out)
                continue
            if out.finish_reason is not None:
                del stream.receivers[out.request_id]
            try:
                r.output(out)
            except Exception:  # noqa: BLE001 - one bad receiver must not end the rest
                log.exception("delivering an output of %s failed", out.request_id)

    def _orphan(self, stream: _Stream, out: RequestOutput) -> None:
        rid = out.request_id
        since = stream.orphans.get(rid)
        if since is None:
            return  # never ours on this channel (or forgotten)
        if out.finish_reason is not None:
            del stream.orphans[rid]
            return
        now = time.monotonic()
        if now - since >= ORPHAN_ABORT_AFTER_S:
            stream.orphans[rid] = now
            log.warning("%s still streams %s after its abort: again", self.client.url, rid)
            self.on_orphan(rid)

    async def _run(self, stream: _Stream) -> None:
        cid = uuid.uuid4().hex
        why = "the worker ended the output stream"
        try:
            async for outs in self.client.outputs(cid, self.open_timeout_s, self.silence_s):
                if not stream.opening.done():
                    stream.id = cid
                    self.opened += 1
                    stream.opening.set_result(cid)
                self._deliver(stream, outs)
        except WorkerError as e:
            why = e.what
            if not stream.opening.done():
                stream.opening.set_exception(e)
        except asyncio.CancelledError:
            why = "the router closed the output stream"
            raise
        except Exception as e:  # noqa: BLE001 - a bug here must still fail the requests
            log.exception("the output stream of %s failed", self.client.url)
            why = f"the output stream failed: {e!r}"
        finally:
            if not stream.opening.done():  # ended, cancelled or failed before it opened
                err = WorkerError(self.client.url, why, True, mark_down=False)
                stream.opening.set_exception(err)
            if self._stream is stream:
                self._stream = None
            stream.id = None
            receivers, stream.receivers = stream.receivers, {}
            for r in receivers.values():
                r.broken(why)
            if receivers:
                log.warning(
                    "output stream of %s ended with %d requests on it: %s",
                    self.client.url,
                    len(receivers),
                    why,
                )
