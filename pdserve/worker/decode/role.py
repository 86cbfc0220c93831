"""The decode role: owns each request, its destination pages, and the room with its P.

A request with a prefill address gets a room (63-bit id, never reused) holding a lease on
pages for its prompt, and a PrefillRequest to that P; it joins the decode batch only on
PrefillDone, when its KV is complete, and takes the room's lease with it. Every room moves
through the D table of `protocol/rooms.py`; its lease is released only on a transition that
carries FREE_PAGES (P confirmed it stopped writing, or the fence expired). Pairing with P
workers (Hello, then Register, before a room's PrefillRequest; Pings) is `PrefillPairing`
(worker/decode/pairing.py); one silent for `peer_timeout_s` is declared dead and its rooms
fenced (LESSONS #7, #8, #9). Time is an input: every verb takes the engine loop's `now`; the
wall clock (write deadlines, ping stamps) is read from the engine's clock, and the bounds are
the role's `PdTiming` (runtime/timing.py).
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from pdserve.engine.commands import SubmitCommand
from pdserve.engine.request import Event, Request
from pdserve.engine.role import RoleHost, Room, StreamFirst
from pdserve.protocol import messages as m
from pdserve.protocol.outputs import DEADLINE_ERROR
from pdserve.protocol.rooms import D_TERMINAL, DEvent, DState
from pdserve.runtime.timing import PD_TIMING, PdTiming
from pdserve.transfer.control import Control, Inbound
from pdserve.transfer.receiver import KVReceiver, open_receiver, register_message
from pdserve.transfer.stager import StagedChunk, Stager
from pdserve.worker.decode.metrics import DecodeMetrics
from pdserve.worker.decode.pairing import PrefillPairing
from pdserve.worker.decode.peers import PrefillPeers
from pdserve.worker.decode.room_machine import DecodeRoomMachine
from pdserve.worker.decode.rooms import WAIT, DRoom, HeldSubmit, blame
from pdserve.worker.decode.snapshot import decode_snapshot
from pdserve.worker.pd_role import RoleStats, SendFailed, pd_pages

log = logging.getLogger(__name__)


class DecodeRole(DecodeRoomMachine):
    """The decode worker's role in its engine's loop (engine/role.py)."""

    name = "decode"

    def __init__(
        self,
        engine: RoleHost,
        identity: str,
        backend: str,
        control: Control | None = None,
        forget: Callable[[str], None] | None = None,
        timing: PdTiming = PD_TIMING,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """`identity`: this worker's control identity (the messages' sender); `backend`: how
        KV reaches its pool; `control`: only read for /debug/state's counters; `forget`: close
        the transport to a prefill worker no longer paired (Control.forget); `timing`: the PD
        protocol's bounds; `registry`: where its metrics go (the engine's; default: a registry
        of their own). The clock is the engine's (`engine.clock`)."""
        super().__init__()
        self.engine = engine
        self.timing = timing
        self.pool = engine.pool
        self.pages = pd_pages(engine)  # what arrives from P: the whole model's pages
        self.identity = identity
        self.receiver: KVReceiver = open_receiver(backend, identity, self.pool, self.pages)
        self.control = control
        self.stager: Stager | None = None  # tcp: the host's stager, read for /debug/state only
        self.by_room: dict[int, DRoom] = {}
        self.by_request: dict[str, DRoom] = {}
        self.admitting: deque[HeldSubmit] = deque()  # waiting for destination pages
        self._room_ids = itertools.count((secrets.randbits(31) << 31) + 1)
        self.stats = RoleStats()
        self.metrics = DecodeMetrics(registry if registry is not None else CollectorRegistry())
        self.outbox: list[m.Send] = []
        self.pairing = PrefillPairing(
            PrefillPeers(timing=timing),  # at most MAX_PREFILL_PEERS, idle ones forgotten
            self._send,
            lambda: register_message(self.receiver, self.pool, self.pages),
            forget or (lambda address: None),
            self.stats,
        )

    @property
    def peers(self) -> PrefillPeers:
        return self.pairing.peers

    @peers.setter
    def peers(self, peers: PrefillPeers) -> None:  # tests bound the set differently
        self.pairing.peers = peers

    def take_outbox(self) -> list[m.Send]:
        out, self.outbox = self.outbox, []
        return out

    # -- inbox -------------------------------------------------------------------------------------
    def handle(self, cmd: object, now: float) -> None:
        match cmd:
            case SubmitCommand(request=req, prefill=str() as address):
                self.metrics.prefill_remote()
                self.admitting.append(HeldSubmit(req, address))
            case SendFailed(peer=peer, msg=msg, why=why):
                self.stats.send_failed += 1
                room = self.by_room.get(msg.room)
                if isinstance(msg, m.PrefillRequest) and room is not None:
                    reason = f"could not reach prefill worker {peer}: {why}"
                    self._apply(room, DEvent.REJECT, now, reason)
            case Inbound(peer=peer, msg=msg):
                self._inbound(peer, msg, None, now)
            case StagedChunk(peer=peer, msg=msg):  # tcp: a KVChunk's pages, checked (stager)
                self._inbound(peer, msg, cmd, now)
            case _:
                raise TypeError(f"decode inbox: unexpected {type(cmd).__name__}")

    def local_prefill(self, req: Request, now: float) -> None:
        """A request with no prefill address: the engine prefills it here (decode-only)."""
        self.metrics.prefill_local(now)

    def command_failed(self, cmd: object, why: str, now: float) -> None:
        """A message or submission whose handling raised ends its own room or request only."""
        if isinstance(cmd, Inbound | StagedChunk):
            room = self.by_room.get(cmd.msg.room)
            if room is not None and room.epoch == cmd.msg.epoch and room.peer == cmd.peer:
                self._apply(room, DEvent.LOCAL_FAIL, now, why)
        elif isinstance(cmd, SubmitCommand):  # the engine fails its request
            for sub in [a for a in self.admitting if a.request is cmd.request]:
                self.admitting.remove(sub)

    def _inbound(
        self, peer: str, msg: m.Message | m.Unreadable, staged: StagedChunk | None, now: float
    ) -> None:
        """A message from prefill worker `peer`; `staged`: a KVChunk's pages (tcp)."""
        self.pairing.heard(peer, msg, now, self.engine.clock.wall())
        if isinstance(msg, m.HelloAck):
            return self._paired(*self.pairing.hello_acked(peer, msg, now), now)
        if isinstance(msg, m.RegisterAck):
            return self._paired(*self.pairing.acked(peer, msg), now)
        if isinstance(msg, m.Pong):
            return
        room = self.by_room.get(msg.room)
        if room is None or room.epoch != msg.epoch or room.peer != peer:
            self.stats.stale[type(msg).__name__] += 1
            return
        match msg:
            case m.PrefillAccept():
                self._apply(room, DEvent.ACCEPT, now)
            case m.PrefillReject(reason=reason):
                if not (msg.unregistered and self.pairing.register_again(room)):
                    why = blame(room, f"prefill worker refused: {reason}", now)
                    self._apply(room, DEvent.REJECT, now, why)
            case m.FirstToken(token=tok, logprob=lp):  # the client has it before the KV lands
                if not 0 <= tok < self.engine.vocab_size:  # PrefillDone's token decides
                    self.stats.unexpected["FirstToken out of the vocabulary"] += 1
                elif (
                    room.state in (DState.PENDING, DState.PREFILLING)
                    and room.done is None
                    and self.engine.streams_early(room.request, tok)
                ):
                    lp = lp if room.request.params.logprobs is not None else None
                    self.effects.append(StreamFirst(room.request, tok, lp))
                    self.metrics.first_tokens_ahead += 1
            case m.PrefillDone():
                room.done = msg
                self._try_done(room, now)
            case m.PrefillFailed(reason=reason):
                event = DEvent.WRITES_CANCELLED if msg.writes_cancelled else DEvent.FAILED
                self._apply(room, event, now, blame(room, f"prefill failed: {reason}", now))
            case m.AbortAck():
                event = DEvent.WRITES_CANCELLED if msg.writes_cancelled else DEvent.ABORT_ACK
                why = "prefill worker cancelled writes it could not confirm"
                self._apply(room, event, now, why)
            case m.KVChunk():
                self._kv_chunk(room, msg, staged, now)
            case _:
                self.stats.unexpected[type(msg).__name__] += 1

    def _try_done(self, room: DRoom, now: float) -> None:
        """Decode once PrefillDone came and, where pages pass through us, all its bytes did."""
        state_bytes = len(room.state_pages(self.pool)) * self.pages.page_bytes
        problem = room.take_done(
            self.receiver.counts_bytes,
            self.receiver.bytes_may_trail,
            state_bytes,
            self.engine.vocab_size,
        )
        if problem == WAIT:
            return
        if problem is not None:
            return self._apply(room, DEvent.FAILED, now, problem)
        self._apply(room, DEvent.DONE, now)

    def _take_landed(self, now: float) -> None:
        """Count what the receiver says landed (tcp frames, nixl notifications) per room."""
        for rid, epoch, nbytes in self.receiver.landed():
            room = self.by_room.get(rid)
            if room is None or room.epoch != epoch or room.state in D_TERMINAL:
                self.stats.stale["landed"] += 1
                continue
            room.bytes_received += nbytes
            self.stats.bytes_written += nbytes
            if room.done is not None:
                self._try_done(room, now)

    def _kv_chunk(
        self, room: DRoom, msg: m.KVChunk, staged: StagedChunk | None, now: float
    ) -> None:
        """`staged`: its pages (None where no stager runs: a KVChunk on shm or nixl)."""
        if room.state in D_TERMINAL or not set(msg.dst_pages) <= room.writable(self.pool):
            self.stats.stale["KVChunk"] += 1  # never write into pages the room does not hold
            return
        if staged is not None and staged.refused:
            self._apply(room, DEvent.FAILED, now, f"bad KV chunk: {staged.refused}")
            return
        rows = staged.rows if staged is not None else None
        try:
            self.receiver.accept_rows(room.room, room.epoch, msg.dst_pages, rows)
        except ValueError as e:
            self._apply(room, DEvent.FAILED, now, f"bad KV chunk: {e}")
            return
        self._take_landed(now)  # counted now: its PrefillDone may be next in the inbox

    def _paired(self, queued: list[int], refused: str | None, now: float) -> None:
        """The rooms that waited on a pairing step: refused, or sent on once registered."""
        for rid in queued:
            room = self.by_room.get(rid)
            if room is not None and refused is not None:
                self._apply(room, DEvent.REJECT, now, refused)
            elif room is not None and room.state is DState.PENDING:
                self._send_prefill(room, now)

    # -- admission ---------------------------------------------------------------------------------
    def admit(self, now: float) -> None:
        """Open a room for each waiting submission, in order, while its pages fit."""
        while self.admitting:
            sub = self.admitting[0]
            req = sub.request
            need = self.pool.pages_needed(len(req.prompt_ids))
            if self.pool.allocator.roomiest(need) is None:  # no part (rank) has them
                return
            if self.pool.state is not None and not self.pool.state.num_free:
                return  # a room takes a state slot too (DeepSeek-V4)
            self.admitting.popleft()
            try:
                self._open_room(sub, need, now)
            except Exception as e:  # noqa: BLE001 - one bad submission must not wedge admission
                log.warning("could not open a room for %s: %s", req.request_id, e)
                why = f"could not start the prefill leg: {type(e).__name__}: {e}"
                self._admit_failed(sub, why, now)

    def _admit_failed(self, sub: HeldSubmit, why: str, now: float) -> None:
        room = self.by_request.get(sub.request.request_id)
        if room is not None:  # the room exists: end it through the table (it owns the pages)
            self._apply(room, DEvent.LOCAL_FAIL, now, why)
            return
        self._end_detached(sub.request, Event.FAIL, why)  # no room, so no pages were leased

    def _open_room(self, sub: HeldSubmit, need: int, now: float) -> None:
        """Destination pages, a room, and its PrefillRequest (or a Register first)."""
        req = sub.request
        left = self.timing.prefill_timeout_s
        if req.deadline is not None:
            left = min(left, req.deadline - now)
        # Pairing first: past the peer limit this request fails and leases nothing.
        peer = self.pairing.open(sub.prefill, self._busy_peers(), now)
        rid = next(self._room_ids)
        # The lease is opened last and the room registered at once: nothing between can raise,
        # so a failed admission either has a room that owns the pages or holds none.
        room = DRoom(
            rid,
            1,
            req,
            sub.prefill,
            now + left,
            self.engine.open_lease(f"room {rid}", need),
            since=now,
            write_deadline=self.engine.clock.wall() + left,
        )
        self.by_room[room.room] = room
        self.by_request[req.request_id] = room
        if self.pairing.join(peer, room.room):  # else it waits for the HelloAck, RegisterAck
            self._send_prefill(room, now)

    def _send_prefill(self, room: DRoom, now: float) -> None:
        req = room.request
        room.requested = now
        self._send(
            room.peer,
            m.PrefillRequest(
                room=room.room,
                epoch=room.epoch,
                prompt_ids=req.prompt_ids,
                dst_pages=list(room.lease.pages),
                state_pages=room.state_pages(self.pool),
                # The request's seed, drawn here if the caller gave none: P samples output
                # position 0 by the same (seed, position) rule as D the rest.
                params=req.params.replace(seed=req.seed),
                write_deadline=room.write_deadline,
            ),
        )

    # -- the loop's verbs ---------------------------------------------------------------
    def abort(self, request_id: str, now: float) -> bool:
        room = self.by_request.get(request_id)
        if room is not None:
            self._end_detached(room.request, Event.ABORT, None)
            self._apply(room, DEvent.LOCAL_ABORT, now)
            return True
        for sub in list(self.admitting):
            if sub.request.request_id == request_id:
                self.admitting.remove(sub)
                self._end_detached(sub.request, Event.ABORT, None)
                return True
        return False

    def rooms(self) -> list[Room]:
        return list(self.by_room.values())

    def has_work(self) -> bool:
        return bool(self.by_room or self.admitting)

    def poll_transfers(self, now: float) -> None:
        self._take_landed(now)

    def expire(self, now: float) -> None:
        """Submissions and rooms past their deadlines end; prefill workers are pinged, and one
        silent for `peer_timeout_s` while rooms wait on it is declared dead."""
        for sub in list(self.admitting):
            if sub.request.deadline is not None and now > sub.request.deadline:
                self.admitting.remove(sub)
                why = f"{DEADLINE_ERROR} waiting for KV pages"
                self._end_detached(sub.request, Event.FAIL, why)
        for room in list(self.by_room.values()):
            if now > room.deadline:
                event = DEvent.FENCE_EXPIRED if room.state is DState.FENCED else DEvent.DEADLINE
                req_deadline = room.request.deadline
                own = req_deadline is not None and now >= req_deadline  # the client's timeout
                what = DEADLINE_ERROR if own else "prefill deadline passed"
                self._apply(room, event, now, f"{what} in state {room.state.value}")
        waiting: dict[str, list[DRoom]] = {}
        for room in self.by_room.values():
            if room.state in (DState.PENDING, DState.PREFILLING, DState.ABORTING):
                waiting.setdefault(room.peer, []).append(room)
        for address in self.pairing.liveness(now, self.engine.clock.wall(), waiting):
            peer = self.peers.get(address)
            # A peer that never proved itself never had our Register: it cannot write into
            # these pages, so they need no fence (a stranger must not hold pages for a minute).
            event = DEvent.PEER_DEAD if peer is None or peer.proven else DEvent.REJECT
            for room in waiting[address]:
                self._apply(room, event, now, f"prefill worker {address} died")
        self.pairing.evict_idle(now, self._busy_peers())

    def _busy_peers(self) -> set[str]:
        return {r.peer for r in self.by_room.values()}

    def settle(self) -> None:
        self.receiver.settle()

    @property
    def hard_exit(self) -> bool:
        return self.receiver.hard_exit

    def snapshot(self, now: float) -> dict[str, Any]:
        return decode_snapshot(
            self.peers,
            self.by_room.values(),
            len(self.admitting),
            self.receiver,
            self.stats,
            self.control.stats.snapshot() if self.control is not None else {},
            self.metrics.snapshot(now),
            now,
            self.stager.snapshot() if self.stager is not None else None,
        )
