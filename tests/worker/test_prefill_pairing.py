"""A decode worker pairs with its prefill workers (worker/decode/pairing.py), without sockets.

Sans-I/O: what it sends is read from a list; the rooms are plain DRooms; the time is passed in.
"""

from __future__ import annotations

import pytest

from pdserve.engine.request import Request
from pdserve.kvcache.allocator import PageAllocator
from pdserve.kvcache.lease import Leases
from pdserve.protocol import messages as m
from pdserve.protocol.rooms import DState
from pdserve.protocol.sampling import SamplingParams
from pdserve.runtime.timing import (
    PEER_ENGINE_STALL_S,
    PEER_IDLE_S,
    PEER_TIMEOUT_S,
    PING_EVERY_S,
    UNPROVEN_BACKOFF_S,
)
from pdserve.worker.decode.pairing import PrefillPairing
from pdserve.worker.decode.peers import MAX_UNPROVEN, PeerLimit, PrefillPeers
from pdserve.worker.decode.rooms import DRoom, PrefillPeer
from pdserve.worker.pd_role import RoleStats

P = "tcp://10.0.0.1:5000"
REGISTER = m.Register(layout={}, backend="shm")
T0, WALL = 1000.0, 1_700_000_000.0  # the monotonic and the wall clock when a test starts


class Harness:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []
        self.forgotten: list[str] = []
        self.stats = RoleStats()
        self.pairing = PrefillPairing(
            PrefillPeers(cap=4, idle_s=PEER_IDLE_S),
            lambda address, msg: self.sent.append((address, type(msg).__name__)),
            lambda: REGISTER,
            self.forgotten.append,
            self.stats,
        )
        self.leases = Leases(PageAllocator(8))

    def prove(self, peer: PrefillPeer) -> tuple[list[int], str | None]:
        """P's HelloAck to the Hello in flight: signed (the control plane checked it), our
        nonce, the address we dialled."""
        assert peer.hello_nonce is not None
        return self.pairing.hello_acked(P, m.HelloAck(nonce=peer.hello_nonce, address=P), T0)

    def room(self, rid: int) -> DRoom:
        req = Request(f"r{rid}", [1, 2, 3], SamplingParams(max_tokens=1), sink=lambda o: None)
        return DRoom(rid, 1, req, P, T0 + 60, self.leases.open(f"room {rid}"), since=T0)


def test_rooms_wait_behind_one_register_and_go_once_it_is_acked():
    h = Harness()
    peer = h.pairing.open(P, busy=(), now=T0)
    assert h.pairing.join(peer, 1) is False and h.pairing.join(peer, 2) is False
    assert h.sent == [(P, "Hello")]  # nothing but a Hello before P proves it holds the key
    assert h.prove(peer) == ([], None) and peer.proven
    assert h.sent == [(P, "Hello"), (P, "Register")]  # one Register, both rooms queued on it
    assert h.pairing.acked(P, m.RegisterAck(ok=True)) == ([1, 2], None)
    assert h.pairing.join(peer, 3) is True and len(h.sent) == 2


def test_a_refusal_fails_the_queued_rooms_and_the_next_room_pairs_anew():
    h = Harness()
    peer = h.pairing.open(P, busy=(), now=T0)
    h.pairing.join(peer, 1)
    h.prove(peer)
    assert h.pairing.acked(P, m.RegisterAck(ok=False, error="dtype")) == ([1], "dtype")
    assert h.pairing.join(peer, 2) is False  # a fresh record: Hello again
    assert h.sent == [(P, "Hello"), (P, "Register"), (P, "Hello")]
    assert h.pairing.peers.get(P) is not peer


def test_an_ack_from_an_address_never_asked_is_counted_and_ignored():
    h = Harness()
    assert h.pairing.acked("tcp://stranger:1", m.RegisterAck(ok=True)) == ([], None)
    assert h.stats.unexpected["RegisterAck"] == 1


def test_a_prefill_worker_that_forgot_us_is_registered_again_once_per_room():
    h = Harness()
    peer = h.pairing.open(P, busy=(), now=T0)
    h.pairing.join(peer, 1)
    h.prove(peer)
    h.pairing.acked(P, m.RegisterAck(ok=True))
    room = h.room(1)
    assert h.pairing.register_again(room) is True and not peer.registered
    assert h.pairing.register_again(room) is False  # the same room again: give up
    other = h.room(2)
    assert h.pairing.register_again(other) is True  # queued behind the Register in flight
    assert h.sent == [(P, "Hello"), (P, "Register"), (P, "Register")]  # proven: no Hello
    assert peer.queued == [1, 2]
    accepted = h.room(3)
    accepted.state = DState.PREFILLING
    assert h.pairing.register_again(accepted) is False  # P accepted it: not a pairing matter


def test_a_pong_from_a_stalled_engine_does_not_prove_the_peer_alive():
    h = Harness()
    peer = h.pairing.open(P, busy=(), now=T0)
    stalled = m.Pong(engine_busy_s=PEER_ENGINE_STALL_S + 1, ping_sent_at=WALL, sent_at=WALL)
    h.pairing.heard(P, stalled, T0 + 1, WALL + 1)
    assert peer.last_pong == T0 and h.stats.stale["pong_engine_stalled"] == 1
    busy = m.Pong(engine_busy_s=PEER_ENGINE_STALL_S, ping_sent_at=WALL, sent_at=WALL)
    h.pairing.heard(P, busy, T0 + 2, WALL + 2)  # stuck no longer than its own bound: alive
    assert peer.last_pong == T0 + 2
    h.pairing.heard(P, m.PrefillAccept(room=1, epoch=1), T0 + 3, WALL + 3)  # any other word
    assert peer.last_pong == T0 + 3 and h.stats.stale["pong_engine_stalled"] == 1


def test_a_silent_peer_with_rooms_waiting_is_declared_dead_and_an_idle_one_forgotten():
    h = Harness()
    peer = h.pairing.open(P, busy=(), now=T0)
    h.pairing.join(peer, 1)
    h.prove(peer)
    h.pairing.acked(P, m.RegisterAck(ok=True))
    room = h.room(1)
    assert h.pairing.liveness(T0 + PEER_TIMEOUT_S, WALL, {P: [room]}) == []  # at the bound
    assert h.sent[-1] == (P, "Ping") and peer.refused is None
    assert h.pairing.liveness(T0 + PEER_TIMEOUT_S + 0.1, WALL, {P: [room]}) == [P]
    assert peer.refused == "declared dead"
    h.pairing.evict_idle(T0 + PEER_IDLE_S, busy=())  # idle for exactly the bound: kept
    assert h.forgotten == [] and h.pairing.peers.get(P) is peer
    h.pairing.evict_idle(T0 + PEER_IDLE_S + 0.1, busy=())
    assert h.forgotten == [P] and h.pairing.peers.get(P) is None


def test_an_unproven_peer_gets_a_hello_only_never_a_register_or_a_ping():
    """A /generate caller named an address that never answers with the cluster key: it hears
    one Hello (no pool reference), no Ping, is declared dead with its rooms, and is refused
    for a while after, so that no caller can make D knock on a host again and again."""
    h = Harness()
    peer = h.pairing.open(P, busy=(), now=T0)
    h.pairing.join(peer, 1)
    h.pairing.join(peer, 2)
    room = h.room(1)
    for k in range(1, 5):  # pinging time, several times over
        assert h.pairing.liveness(T0 + k * (PING_EVERY_S + 0.1), WALL, {P: [room]}) == []
    assert h.sent == [(P, "Hello")]
    # An ack from a RegisterAck it was never sent (a peer with the key but no Hello answer).
    assert h.pairing.acked(P, m.RegisterAck(ok=True)) == ([], None)
    assert h.stats.unexpected["RegisterAck"] == 1 and peer.queued == [1, 2]
    dead_at = T0 + PEER_TIMEOUT_S + 0.1
    assert h.pairing.liveness(dead_at, WALL, {P: [room]}) == [P]
    assert h.sent == [(P, "Hello")]
    with pytest.raises(PeerLimit, match="did not prove"):
        h.pairing.open(P, busy={P}, now=dead_at)  # refused during the backoff, record or not
    h.pairing.evict_idle(dead_at + PEER_IDLE_S + 0.1, busy=())
    assert h.forgotten == [P]
    with pytest.raises(PeerLimit, match="did not prove"):
        h.pairing.open(P, busy=(), now=dead_at + UNPROVEN_BACKOFF_S - 0.1)
    assert h.pairing.open(P, busy=(), now=dead_at + UNPROVEN_BACKOFF_S + 0.1).proven is False


def test_a_hello_ack_that_names_another_address_or_nonce_proves_nothing():
    h = Harness()
    peer = h.pairing.open(P, busy=(), now=T0)
    h.pairing.join(peer, 1)
    nonce = peer.hello_nonce
    assert nonce is not None
    wrong = m.HelloAck(nonce=nonce + 1, address=P)
    assert h.pairing.hello_acked(P, wrong, T0) == ([], None) and not peer.proven
    assert h.stats.unexpected["HelloAck"] == 1
    relayed = m.HelloAck(nonce=nonce, address="tcp://10.0.0.2:5000")  # another P's answer
    queued, why = h.pairing.hello_acked(P, relayed, T0)
    assert queued == [1] and why is not None and "relayed" in why
    assert not peer.proven and h.sent == [(P, "Hello")]
    with pytest.raises(PeerLimit, match="did not prove"):
        h.pairing.open(P, busy=(), now=T0)


def test_unproven_addresses_are_bounded_and_a_proven_one_is_never_backed_off():
    h = Harness()
    h.pairing.peers = PrefillPeers(cap=MAX_UNPROVEN + 4, idle_s=PEER_IDLE_S)
    for i in range(MAX_UNPROVEN):
        h.pairing.join(h.pairing.open(f"tcp://10.9.0.{i}:1", busy=(), now=T0), i)
    with pytest.raises(PeerLimit, match="still to prove"):
        h.pairing.open("tcp://10.9.1.1:1", busy=(), now=T0)
    # A proven peer that later goes silent is not backed off: it is paired again at once.
    h2 = Harness()
    p2 = h2.pairing.open(P, busy=(), now=T0)
    h2.pairing.join(p2, 1)
    h2.prove(p2)
    h2.pairing.acked(P, m.RegisterAck(ok=True))
    dead_at = T0 + PEER_TIMEOUT_S + 0.1
    assert h2.pairing.liveness(dead_at, WALL, {P: [h2.room(1)]}) == [P]
    again = h2.pairing.open(P, busy={P}, now=dead_at)
    assert h2.pairing.join(again, 2) is False and h2.sent[-1] == (P, "Hello")
