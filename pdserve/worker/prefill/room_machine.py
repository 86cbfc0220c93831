"""How a prefill room moves: a P-table event entered (protocol/rooms.py `step_p`), its commands
run, and its request's pages taken over from the engine (`kept`).

A part of `PrefillRole` (worker/prefill/role.py), apart like the engine's `RequestEnds` so that
the role reads as its verbs; it reads only the role parts named below. Its invariants: a room
asks its request out of the batch once (`KeepPages`, `in_batch`), its pages reach it through
`kept` before COMPUTED is applied, and FREE_PAGES is the one release of them, once no write
reads them (LESSONS #7). A room that reaches a terminal state is forgotten at once.
"""

from __future__ import annotations

import msgspec

from pdserve.engine.request import Event, Request
from pdserve.engine.role import KeepPages, Role
from pdserve.kvcache.lease import Lease
from pdserve.protocol import messages as m
from pdserve.protocol.rooms import P_TERMINAL, Cmd, PEvent, step_p
from pdserve.worker.pd_role import RoleStats, enter
from pdserve.worker.prefill.rooms import PRoom
from pdserve.worker.prefill.writes import WAITING_FOR_WRITES


class PrefillRoomMachine(Role):
    """The prefill role's rooms as state machines, over the role's own tables and outbox."""

    identity: str
    by_room: dict[tuple[str, int], PRoom]
    by_request: dict[str, PRoom]
    stats: RoleStats
    outbox: list[m.Send]

    def _reply(self, peer: str, msg: m.Msg) -> None:
        self.outbox.append(m.Send(peer, msgspec.structs.replace(msg, sender=self.identity)))

    def _apply(self, room: PRoom, event: PEvent, now: float, reason: str = "") -> None:
        out = step_p(room.state, event)
        if not enter(room, out, event.value, reason, self.stats, now):
            return
        for c in out.commands:
            self._run_command(room, c)
        if room.state in WAITING_FOR_WRITES and not room.inflight:
            self._apply(room, PEvent.WRITES_DONE, now)
        if room.state in P_TERMINAL:
            self.by_room.pop((room.peer, room.room), None)
            self.by_request.pop(room.request.request_id, None)

    def _run_command(self, room: PRoom, c: Cmd) -> None:
        match c:
            case Cmd.STOP_COMPUTE:
                self._leave_batch(room, Event.ABORT)  # writes may still read its pages
            case Cmd.FREE_PAGES:  # the one release of a room's pages: no write reads them
                self._leave_batch(room, Event.STOP)  # a no-op: every path left the batch
                if room.lease is not None:
                    room.lease.release()
                    room.lease = None
            case Cmd.SEND_FIRST_TOKEN:  # with no write in flight PrefillDone follows at once
                if room.inflight and room.sends_first_token:
                    self._reply(room.peer, room.first_token_message())
            case Cmd.SEND_DONE:
                self.stats.done += 1
                self.stats.bytes_acked += room.bytes_written  # reported to D as complete
                self._reply(room.peer, room.done_message())
            case Cmd.SEND_FAILED:
                self.stats.failed += 1
                self._reply(
                    room.peer,
                    m.PrefillFailed(
                        room=room.room,
                        epoch=room.epoch,
                        reason=room.reason or "prefill failed",
                        writes_cancelled=room.writes_cancelled,
                    ),
                )
            case Cmd.SEND_ABORT_ACK:
                self.stats.aborted += 1
                self._reply(
                    room.peer,
                    m.AbortAck(
                        room=room.room,
                        epoch=room.epoch,
                        known=True,
                        writes_cancelled=room.writes_cancelled,
                    ),
                )
            case Cmd.CANCEL_WRITES:
                for xfer in room.inflight:
                    xfer.cancel()
                    room.writes_cancelled = True
                room.inflight.clear()
            case _:
                raise ValueError(f"prefill role cannot run {c}")

    def _leave_batch(self, room: PRoom, event: Event) -> None:
        """Ask the engine to end the room's request if it is still in the batch, its lease
        passing to the room (`kept`)."""
        if room.in_batch:
            room.in_batch = False
            self.effects.append(KeepPages(room.request, event, f"room {room.room}"))

    def kept(self, req: Request, lease: Lease | None, now: float) -> None:
        """The room's request left the batch, its pages (`lease`, None if it held none) the
        room's from now on. A room that ended in the verb that asked (no write in flight: its
        FREE_PAGES found no pages) frees them at once; a computed one goes on (COMPUTED) with
        them, and its FREE_PAGES releases them once no write reads them."""
        room = self.by_request.get(req.request_id)
        if room is None:
            if lease is not None:
                lease.release()
            return
        if lease is not None:  # the request leaves the batch once, so the room had none
            room.lease = lease
        if room.first_token is not None:  # it left computed (take_token)
            self._apply(room, PEvent.COMPUTED, now)
