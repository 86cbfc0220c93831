"""The prefill role: computes prompts' KV for decode workers and writes it into their pages.

The engine thread owns every room (one decode worker's request) and drives it through the P
table of `protocol/rooms.py`. A room's pages are written as soon as the chunk that fills
them is computed; PrefillDone follows only after the last write completed. While a write is
in flight (nixl completes in the background) the scheduler never preempts the request. When
it leaves the batch (its prompt computed, or STOP_COMPUTE) its lease passes to the room, which
releases it in one place, FREE_PAGES, once no write reads the pages (LESSONS #7). Anything a
peer sends is answered or counted and dropped: ABORT for an unknown or finished room gets an
AbortAck with known=False, never an assert (LESSONS #1, #3). The writes themselves are posted
and polled by `PrefillWrites` (worker/prefill/writes.py); a room's events are entered and its
commands run by `PrefillRoomMachine` (worker/prefill/room_machine.py), this role's base. Time
is an input: every verb takes the engine loop's `now`, and the wall clock (write deadlines, a
Pong's stamp) is read from the engine's clock; the bounds are the role's `PdTiming`
(runtime/timing.py).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from pdserve.engine.request import Event, Request, TokenLogprob
from pdserve.engine.role import ComputePrompt, RoleHost, Room
from pdserve.engine.scheduler import StepPlan
from pdserve.protocol import messages as m
from pdserve.protocol.rooms import PEvent
from pdserve.runtime.timing import PD_TIMING, PdTiming
from pdserve.transfer.control import Control, Inbound
from pdserve.transfer.copier import Copier
from pdserve.transfer.nixl import NixlAgent
from pdserve.worker.pd_role import RoleStats, SendFailed, pd_pages
from pdserve.worker.prefill.metrics import PrefillMetrics
from pdserve.worker.prefill.peers import DecodePeer, DecodePeers
from pdserve.worker.prefill.room_machine import PrefillRoomMachine
from pdserve.worker.prefill.rooms import PRoom, check_prefill_request
from pdserve.worker.prefill.snapshot import prefill_snapshot
from pdserve.worker.prefill.writes import PrefillWrites

log = logging.getLogger(__name__)

REFUSALS_KEPT = 16


class PrefillRole(PrefillRoomMachine):
    """The prefill worker's role in its engine's loop (engine/role.py)."""

    name = "prefill"
    overlaps = False  # the first token and the written pages go to D at once
    takes_tokens = True  # a room's first token goes to D, not to a client
    works_while_waiting = True  # finished writes are answered mid-step (`while_waiting`)

    def __init__(
        self,
        engine: RoleHost,
        identity: str,
        control: Control | None = None,
        copier: Copier | None = None,
        address: str | None = None,
        timing: PdTiming = PD_TIMING,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """`identity`: this worker's control identity (the messages' sender). `control`: the
        tcp backend's data plane sends page frames on it (the role's own messages go out
        through `take_outbox`); None where no tcp peer may register. `copier`: the data-plane
        worker that runs shm/tcp page copies off the engine thread. `address`: the control
        address decode workers dial (HelloAck names it); default: `control`'s bound one.
        `timing`: the PD protocol's bounds. `registry`: where its metrics go (the engine's;
        default: a registry of their own). The clock is the engine's (`engine.clock`)."""
        super().__init__()
        self.engine = engine
        self.timing = timing
        self.pool = engine.pool
        self.pages = pd_pages(engine)  # what crosses to D: the whole model's pages
        self.identity = identity
        self.address = address if address is not None else (control.address if control else "")
        self.control = control
        self.copier = copier
        self.peers = DecodePeers(self.pool, self.pages, identity, control, copier, timing)
        self.by_room: dict[tuple[str, int], PRoom] = {}
        self.by_request: dict[str, PRoom] = {}
        self.stats = RoleStats()
        self.metrics = PrefillMetrics(  # read at scrape time, from the scraping thread
            registry if registry is not None else CollectorRegistry(),
            self.stats,
            lambda: [room.peer for room in list(self.by_room.values())],
            lambda: list(self.peers.by_id),
        )
        # The last registrations refused, (when, peer, why), for /debug/state.
        self.refusals: deque[tuple[float, str, str]] = deque(maxlen=REFUSALS_KEPT)
        self.outbox: list[m.Send] = []
        self.writes = PrefillWrites(
            self.pool,
            self.pages,
            self.peers,
            self.stats,
            self._apply,
            lambda peer, why, now: self._drop_peer(peer, why, now, lost=True),
        )

    @property
    def nixl(self) -> NixlAgent | None:
        return self.peers.nixl

    def pins(self, req: Request) -> bool:
        room = self.by_request.get(req.request_id)
        return room is not None and bool(room.inflight)

    def take_outbox(self) -> list[m.Send]:
        out, self.outbox = self.outbox, []
        return out

    # -- inbox ------------------------------------------------------------------------------
    def handle(self, cmd: object, now: float) -> None:
        if isinstance(cmd, SendFailed):
            self.stats.send_failed += 1
            lost = self.by_room.get((cmd.peer, cmd.msg.room))
            if isinstance(cmd.msg, m.KVChunk) and lost is not None and lost.epoch == cmd.msg.epoch:
                self._apply(lost, PEvent.WRITE_FAILED, now, f"KV chunk not sent: {cmd.why}")
            return
        if not isinstance(cmd, Inbound):
            raise TypeError(f"prefill inbox: unexpected {type(cmd).__name__}")
        peer = self.peers.get(cmd.peer)
        if peer is not None:
            peer.last_seen = now
        msg = cmd.msg
        match msg:
            case m.Register():
                self._register(cmd.peer, msg, now)
            case m.PrefillRequest():
                self._prefill_request(cmd.peer, msg, now)
            case m.Abort():
                room = self.by_room.get((cmd.peer, msg.room))
                if room is None or room.epoch != msg.epoch:
                    self._reply(cmd.peer, m.AbortAck(room=msg.room, epoch=msg.epoch, known=False))
                else:
                    self._apply(room, PEvent.ABORT, now)
            case m.Ping() | m.Hello():
                pass  # answered on the control thread (on_control); here it only proves D alive
            case m.Unreadable(of="PrefillRequest") if msg.room:
                if self._is_live(cmd.peer, msg.room, msg.epoch):
                    return  # a garbled copy of a room we serve: its answer stands
                self.stats.rejected += 1
                why = f"bad request: {msg.detail}"
                self._reply(cmd.peer, m.PrefillReject(room=msg.room, epoch=msg.epoch, reason=why))
            case m.Unreadable(of="Register"):
                ours = self.pages.layout.to_desc()
                error = f"unreadable Register: {msg.detail}"
                self._reply(cmd.peer, m.RegisterAck(ok=False, error=error, layout=ours))
            case _:
                self.stats.unexpected[type(msg).__name__] += 1

    def _is_live(self, peer: str, room: int, epoch: int) -> bool:
        """Whether (room, epoch) from `peer` is a room this worker serves: a copy of its
        PrefillRequest is stale, never refused (a refusal would make D free pages that this
        room's writes still fill; LESSONS #7)."""
        live = self.by_room.get((peer, room))
        if live is None or live.epoch != epoch:
            return False
        self.stats.stale["PrefillRequest"] += 1
        return True

    def command_failed(self, cmd: object, why: str, now: float) -> None:
        """A peer's message whose handling raised fails its room (or is refused), nothing more."""
        if not isinstance(cmd, Inbound):
            return
        msg = cmd.msg
        room = self.by_room.get((cmd.peer, msg.room))
        if room is not None and room.epoch == msg.epoch:
            self._apply(room, PEvent.LOCAL_FAIL, now, why)
        elif isinstance(msg, m.PrefillRequest):
            self.stats.rejected += 1
            self._reply(cmd.peer, m.PrefillReject(room=msg.room, epoch=msg.epoch, reason=why))

    def fail(self, req: Request, why: str, now: float) -> bool:
        """A step, or an effect this role asked, failed this room's request: the room fails (D
        hears PrefillFailed). A request still unfinished is still in the batch, even if a
        KeepPages asked it out (its ending raised): the room's STOP_COMPUTE asks again."""
        room = self.by_request.get(req.request_id)
        if room is None:
            return False
        if not req.status.finished:
            room.in_batch = True
        self._apply(room, PEvent.LOCAL_FAIL, now, why)
        return True

    def on_control(self, inbound: Inbound, now: float) -> m.Send | None:
        """Pings and Hellos are answered here, on the control thread. Answering from the engine
        made a step longer than D's 5 s silence bound (a big prompt chunk on a CPU) look like
        death, though P's own heartbeat allows 30 s. The Pong says how long the engine has
        been in its current tick; D judges a stall by that. Reads one float of engine state.
        The HelloAck (signed with the cluster key, like every frame) is D's proof that we are
        a prefill worker of its cluster at the address it dialled (worker/decode/pairing.py)."""
        if isinstance(inbound.msg, m.Hello):
            ack = m.HelloAck(nonce=inbound.msg.nonce, address=self.address, sender=self.identity)
            return m.Send(inbound.peer, ack)
        if not isinstance(inbound.msg, m.Ping):
            return None
        busy = round(max(0.0, now - self.engine.last_tick), 3)
        pong = m.Pong(
            nonce=inbound.msg.nonce,
            engine_busy_s=busy,
            ping_sent_at=inbound.msg.sent_at,
            sent_at=self.engine.clock.wall(),
            sender=self.identity,
        )
        return m.Send(inbound.peer, pong)

    def _register(self, peer: str, msg: m.Register, now: float) -> None:
        ours = self.pages.layout.to_desc()
        try:
            self.peers.register(peer, msg, now)
        except Exception as e:  # noqa: BLE001 - ValueError, OSError, NIXL errors: refuse, say why
            log.warning("refused registration of %s: %s", peer[:80], e)
            self.refusals.append((now, peer[:80], str(e)[:300]))
            self._reply(peer, m.RegisterAck(ok=False, error=str(e), layout=ours))
            return
        log.info("registered decode worker %s (%s)", peer, msg.backend)
        self._reply(peer, m.RegisterAck(ok=True, layout=ours))

    def _prefill_request(self, peer_id: str, msg: m.PrefillRequest, now: float) -> None:
        def reject(reason: str, unregistered: bool = False) -> None:
            self.stats.rejected += 1
            self._reply(
                peer_id,
                m.PrefillReject(
                    room=msg.room, epoch=msg.epoch, reason=reason, unregistered=unregistered
                ),
            )

        peer = self.peers.get(peer_id)
        if peer is None:
            return reject("not registered", unregistered=True)
        if self._is_live(peer_id, msg.room, msg.epoch):
            return  # a duplicate: the room is ours already, and D's pages are its writes' own
        if (peer_id, msg.room) in self.by_room:  # an older attempt still ends here
            return reject(f"room {msg.room} is already in progress")
        need = self.pool.pages_needed(len(msg.prompt_ids))
        wall = self.engine.clock.wall()
        state = None
        if self.pool.state is not None:
            each = self.pool.state.pages_each
            state = (range(peer.num_pages, peer.num_pages + peer.state_slots * each), each)
        checked = check_prefill_request(
            msg, peer.dst_limit, need, self.engine.validate, wall, state
        )
        if isinstance(checked, str):
            return reject(checked)
        params, left = checked
        deadline = now + min(left, self.engine.request_timeout_s)
        req = Request(
            f"{peer_id}:{msg.room}:{msg.epoch}",
            list(msg.prompt_ids),
            params,
            sink=lambda _o: None,
            eos_token_ids=self.engine.eos_token_ids,  # min_tokens bans EOS here too
            deadline=deadline,
            arrival=now,
        )
        room = PRoom(
            peer_id,
            peer.generation,
            msg.room,
            msg.epoch,
            req,
            list(msg.dst_pages),
            deadline,
            since=now,
            write_deadline=msg.write_deadline,
            state_pages=list(msg.state_pages),
            sends_first_token=peer.first_tokens,
        )
        self.by_room[(peer_id, msg.room)] = room
        self.by_request[req.request_id] = room
        self.effects.append(ComputePrompt(req))
        self._reply(peer_id, m.PrefillAccept(room=msg.room, epoch=msg.epoch))

    # -- the loop's verbs -------------------------------------------------------------------------
    def after_forward(self, plan: StepPlan, now: float) -> None:
        """Post writes of the pages this step completed (worker/prefill/writes.py)."""
        self.writes.post(plan, self.by_request, now, self.engine.clock.wall())

    def take_token(self, req: Request, tok: int, lp: TokenLogprob | None, now: float) -> bool:
        """The first token of a room's prompt: the room is computed (P streams nothing). Its
        request leaves the batch, and the room goes on once its pages are the room's (`kept`)."""
        room = self.by_request.get(req.request_id)
        if room is None:  # not a room (cannot happen: P serves no local requests)
            return False
        room.first_token, room.first_logprob = tok, lp
        self._leave_batch(room, Event.STOP)  # the prompt is computed; writes still read it
        return True

    def abort(self, request_id: str, now: float) -> bool:
        room = self.by_request.get(request_id)
        if room is not None:
            self._apply(room, PEvent.ABORT, now)
        return room is not None

    def rooms(self) -> list[Room]:
        return list(self.by_room.values())

    def has_work(self) -> bool:
        return any(r.inflight for r in self.by_room.values())

    def poll_transfers(self, now: float) -> None:
        """Collect completed writes; a failed or overdue one fails its room."""
        self.peers.tick(now)
        self.writes.poll(self.by_room.values(), now)

    def while_waiting(self, now: float, in_step: Callable[[Request], bool]) -> None:
        """Mid-step: collect the finished writes of rooms whose request left the batch before
        this step, so that their PrefillDone goes to D now rather than after the step (a prompt
        step takes milliseconds), with UCX progressed meanwhile. A room still in the batch, or
        computed by this step (one failed as it launched: the device may still write its
        pages, which its end would free), waits for the tick, and so does dropping a peer found
        gone (it fails such rooms)."""
        if self.nixl is not None:
            self.nixl.progress()
        rooms = [
            r
            for r in self.by_room.values()
            if r.inflight and not r.in_batch and not in_step(r.request)
        ]
        self.writes.poll(rooms, now, drop_peers=False)

    def expire(self, now: float) -> None:
        """Rooms past their deadline fail; decode workers silent too long are dropped."""
        for room in list(self.by_room.values()):
            if now > room.deadline:
                self._apply(room, PEvent.DEADLINE, now, "prefill deadline passed")
        for peer in self.peers.silent(now):
            self._drop_peer(peer, f"silent for {now - peer.last_seen:.0f}s", now, lost=False)

    def _drop_peer(self, peer: DecodePeer, why: str, now: float, *, lost: bool) -> None:
        """Forget a decode worker and fail every room it had, at once.

        `lost`: the transfer layer said the peer disconnected, so no write to it can complete:
        PEER_LOST releases them now and tells D the room failed (D, if alive after all, fences
        the pages) instead of waiting for each write's own error or deadline. A silent peer's
        writes may still be moving: PEER_DEAD lets its rooms wait for them as usual. Either way
        D pairs again by registering anew."""
        log.warning("decode worker %s: %s; dropping it and failing its rooms", peer.identity, why)
        self.stats.peers_dropped["disconnected" if lost else "silent"] += 1
        self.peers.drop(peer, now)
        event = PEvent.PEER_LOST if lost else PEvent.PEER_DEAD
        for room in [r for r in self.by_room.values() if r.peer == peer.identity]:
            self._apply(room, event, now, f"decode worker gone: {why}")

    def settle(self) -> None:
        if self.nixl is not None:
            self.nixl.settle()

    @property
    def hard_exit(self) -> bool:
        return self.nixl is not None

    def snapshot(self, now: float) -> dict[str, Any]:
        return prefill_snapshot(
            self.peers,
            self.by_room.values(),
            self.refusals,
            self.stats,
            self.control.stats.snapshot() if self.control is not None else {},
            now,
        )
