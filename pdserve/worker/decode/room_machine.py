"""How a decode room moves: a D-table event entered (protocol/rooms.py `step_d`), the deadline
of the state it entered set, and its commands run.

A part of `DecodeRole` (worker/decode/role.py), apart like the prefill side's
`PrefillRoomMachine` so that the role reads as its verbs; it reads only the role parts named
below. Its invariants: FREE_PAGES is the one release of a room's pages (LESSONS #7),
START_DECODE hands them to the request in an `Adopt`, whose `started` counts the transfer once
the engine took it, and a room that reaches a terminal state is forgotten at once, even when a
command raised.
"""

from __future__ import annotations

from functools import partial

import msgspec

from pdserve.engine.request import Event, Request
from pdserve.engine.role import Adopt, Finish, Role, RoleHost
from pdserve.protocol import messages as m
from pdserve.protocol.rooms import D_TERMINAL, Cmd, DEvent, DState, step_d
from pdserve.runtime.faults import FAULTS
from pdserve.runtime.timing import PdTiming
from pdserve.worker.decode.metrics import DecodeMetrics
from pdserve.worker.decode.rooms import DRoom
from pdserve.worker.pd_role import RoleStats, enter


class DecodeRoomMachine(Role):
    """The decode role's rooms as state machines, over the role's own tables and outbox."""

    engine: RoleHost
    identity: str
    timing: PdTiming
    by_room: dict[int, DRoom]
    by_request: dict[str, DRoom]
    stats: RoleStats
    metrics: DecodeMetrics
    outbox: list[m.Send]

    def _send(self, peer: str, msg: m.Msg) -> None:
        self.outbox.append(m.Send(peer, msgspec.structs.replace(msg, sender=self.identity)))

    def _apply(self, room: DRoom, event: DEvent, now: float, reason: str = "") -> None:
        out = step_d(room.state, event)
        if not enter(room, out, event.value, reason, self.stats, now):
            return
        t = self.timing
        if room.state is DState.ABORTING:
            room.deadline = now + t.abort_ack_timeout_s
        elif room.state is DState.FENCED:
            # P may still write until write_deadline (unix time); quarantine the pages past it,
            # converted to monotonic time with both clocks read together.
            clock = self.engine.clock
            mono, wall = clock.monotonic(), clock.wall()
            past_writes = mono + (room.write_deadline + t.fence_margin_s - wall)
            room.deadline = max(now + t.fence_s, past_writes)
        try:
            for c in out.commands:
                self._run_command(room, c, now)
        finally:  # a command that raised still leaves a finished room finished
            if room.state in D_TERMINAL:
                self.by_room.pop(room.room, None)
                self.by_request.pop(room.request.request_id, None)

    def _run_command(self, room: DRoom, c: Cmd, now: float) -> None:
        req = room.request
        match c:
            case Cmd.SEND_ABORT:
                self._send(room.peer, m.Abort(room=room.room, epoch=room.epoch))
            case Cmd.FREE_PAGES:  # the one release of a room's pages: ack, failure or fence
                room.lease.release()
            case Cmd.FAIL_REQUEST:
                self._end_detached(req, Event.FAIL, room.reason or "prefill failed")
            case Cmd.START_DECODE:
                assert room.first_token is not None  # set with the DONE event
                try:
                    FAULTS.hit("d.start_decode")
                    lease = room.lease.hand_over(req.request_id)
                except Exception:  # the request never starts: its pages go back, it fails
                    room.lease.release()
                    self._end_detached(req, Event.FAIL, "its decode could not start")
                    raise
                lp = room.first_logprob if req.params.logprobs is not None else None
                started = partial(self._decoding, room)  # counted once the engine took it
                self.effects.append(Adopt(req, lease, room.first_token, lp, started))
            case _:
                raise ValueError(f"decode role cannot run {c}")

    def _decoding(self, room: DRoom, now: float) -> None:
        """`room`'s request is decoding (its Adopt applied): a completed transfer."""
        self.stats.done += 1
        if room.done is not None:  # what it decodes on (a room aborted first decodes nothing)
            self.stats.bytes_acked += room.done.kv_bytes
        self.metrics.kv_complete(room, now)

    def _end_detached(self, req: Request, event: Event, error: str | None) -> None:
        """End a request that is not in the scheduler, leaving its pages to the room."""
        self.effects.append(Finish(req, event, error))
