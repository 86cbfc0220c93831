"""The decode role's pairing with its prefill workers: Hello, Register, their acks, Ping.

A new peer first gets a Hello with a fresh nonce, and nothing else until its HelloAck: the
control plane drops a frame not signed with the cluster key, so an authentic HelloAck that
echoes the nonce and names the address we dialled proves the peer is a prefill worker of this
cluster, not merely an address a /generate caller named (nor a relay of another worker's
answer: that names the other worker's address). Only then does our Register go out, with the
pool reference (shm) or NIXL metadata that lets a peer write into our memory. A peer that
never proves itself is never pinged and is declared dead like any silent peer; its address is
then refused for a while (worker/decode/peers.py).

A prefill worker computes a decode worker's rooms only once it accepted that worker's Register
(its KV layout and the data plane to write into). So a room's PrefillRequest waits, queued on
its peer, for the RegisterAck, with at most one Register in flight per peer; a refusal fails
every room queued on it. A P that restarted and forgot us rejects a room as unregistered: we
register again, once per room. Peers are pinged every `ping_every_s`; any word from one proves
it alive, except a Pong saying its engine has been stuck in one tick past `peer_engine_stall_s`
(runtime/timing.py `PdTiming`).

The peer set itself (its cap, idle eviction, who is due a ping or dead) is `PrefillPeers`
(worker/decode/peers.py); what becomes of the rooms stays with the decode role, which owns
them (worker/decode/role.py). Sans-I/O: messages go out through `send`, transports close through
`forget`, and the caller passes the time (`now` monotonic, `wall` unix). Owned by the engine
thread, like the rest of the decode role.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Collection, Mapping, Sequence

from pdserve.protocol import messages as m
from pdserve.protocol.rooms import DState
from pdserve.worker.decode.peers import PrefillPeers
from pdserve.worker.decode.rooms import DRoom, PrefillPeer
from pdserve.worker.pd_role import RoleStats

log = logging.getLogger(__name__)


class PrefillPairing:
    def __init__(
        self,
        peers: PrefillPeers,
        send: Callable[[str, m.Msg], None],
        register: Callable[[], m.Msg],
        forget: Callable[[str], None],
        stats: RoleStats,
    ) -> None:
        """`peers`: the peer set, whose `timing` bounds the pairing too. `send(address, msg)`:
        queue a message to a prefill worker; `register()`: this decode worker's Register;
        `forget(address)`: close the transport to a peer no longer paired."""
        self.peers = peers
        self.send = send
        self.register = register
        self.forget = forget
        self.stats = stats

    def heard(self, address: str, msg: m.Msg, now: float, wall: float) -> None:
        """Any message from `address` proves it alive; a Pong also times its clock."""
        timing = self.peers.timing
        peer = self.peers.get(address)
        stalled = isinstance(msg, m.Pong) and msg.engine_busy_s > timing.peer_engine_stall_s
        if peer is not None and not stalled:
            peer.last_pong = now  # any word from P proves it alive...
        if stalled:  # ...but a Pong from a P whose engine is stuck in one tick does not
            self.stats.stale["pong_engine_stalled"] += 1
        if peer is not None and isinstance(msg, m.Pong):
            peer.clock.observe(msg.ping_sent_at, msg.sent_at, wall, now, timing)

    def open(self, address: str, busy: Collection[str], now: float) -> PrefillPeer:
        """The peer at `address`, before a room leases pages for it. Raises PeerLimit when all
        MAX_PREFILL_PEERS are busy (that request fails, leasing nothing); closes the transports
        of peers forgotten to make room. `busy`: the addresses with open rooms."""
        peer, gone = self.peers.open(address, now, busy)
        for forgotten in gone:
            self.forget(forgotten)
        return peer

    def join(self, peer: PrefillPeer, room: int) -> bool:
        """True: `room`'s PrefillRequest may go to `peer` now. False: it waits for the
        RegisterAck (a Register is sent unless one is in flight). A peer that refused us or was
        declared dead is paired anew."""
        if peer.refused is not None:
            peer = self.peers.replace(peer.address)
        if peer.registered:
            return True
        self._queue(peer, room)
        return False

    def register_again(self, room: DRoom) -> bool:
        """P restarted and forgot us: pair again and resend `room` (once); False: give up."""
        peer = self.peers.get(room.peer)
        if peer is None or room.state is not DState.PENDING or room.reregistered:
            return False
        room.reregistered, peer.registered = True, False
        if not peer.queued:
            log.warning("prefill worker %s forgot us (restarted?): registering again", peer.address)
        self._queue(peer, room.room)
        return True

    def _queue(self, peer: PrefillPeer, room: int) -> None:
        if not peer.queued:  # no Hello or Register in flight yet
            if peer.proven:
                self.send(peer.address, self.register())
            else:
                peer.hello_nonce = secrets.randbits(63)
                self.send(peer.address, m.Hello(nonce=peer.hello_nonce))
        peer.queued.append(room)

    def hello_acked(
        self, address: str, msg: m.HelloAck, now: float
    ) -> tuple[list[int], str | None]:
        """A HelloAck from `address`: ([], None) once it proved itself (our Register is on its
        way and the rooms keep waiting for the RegisterAck); (the rooms that waited, why) when
        it names another address; ([], None), counted, for one we did not ask for."""
        peer = self.peers.get(address)
        if peer is None or peer.proven or msg.nonce != peer.hello_nonce:
            self.stats.unexpected["HelloAck"] += 1
            return [], None
        peer.hello_nonce = None
        if msg.address != address:
            why = (
                f"{address} answered our Hello as {msg.address[:80]!r}: another worker's "
                "answer, relayed; not paired"
            )
            log.error("%s", why)
            queued, peer.queued, peer.refused = peer.queued, [], why
            self.peers.failed_proof(address, now)
            return queued, why
        self.peers.proved(address)
        if peer.queued:
            self.send(address, self.register())
        return [], None

    def acked(self, address: str, msg: m.RegisterAck) -> tuple[list[int], str | None]:
        """A RegisterAck from `address`: (the rooms that waited for it, None) when P paired us,
        (those rooms, why) when it refused; ([], None) from an address we never asked."""
        peer = self.peers.get(address)
        if peer is None or not peer.proven:  # we sent it no Register
            self.stats.unexpected["RegisterAck"] += 1
            return [], None
        queued, refused = self.peers.acked(address, msg.ok, msg.error)
        if refused is not None:
            log.error("prefill worker %s refused us: %s", address, refused)
        return queued, refused

    def liveness(
        self, now: float, wall: float, waiting: Mapping[str, Sequence[DRoom]]
    ) -> list[str]:
        """Ping the peers due a ping (stamped `wall`); return the addresses declared dead:
        silent for `peer_timeout_s` while rooms wait on them. `waiting`: those rooms, by
        address."""
        since = {address: min(r.since for r in rooms) for address, rooms in waiting.items()}
        pings, dead = self.peers.liveness(now, since)
        for peer in pings:
            self.send(peer.address, m.Ping(sent_at=wall))
        for peer, waited in dead:
            log.warning("prefill worker %s silent for %.1fs: declared dead", peer.address, waited)
        return [peer.address for peer, _ in dead]

    def evict_idle(self, now: float, busy: Collection[str]) -> None:
        """Forget the peers idle for the set's `idle_s` and close their transports."""
        for address in self.peers.evict_idle(now, busy):
            self.forget(address)
