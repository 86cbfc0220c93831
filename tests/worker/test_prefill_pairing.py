"""A decode worker pairs with its prefill workers (worker/prefill_pairing.py), without sockets.

Sans-I/O: what it sends is read from a list; the rooms are plain DRooms.
"""

from __future__ import annotations

import time

from pdserve.engine.request import Request
from pdserve.kvcache.allocator import PageAllocator
from pdserve.kvcache.lease import Leases
from pdserve.protocol import messages as m
from pdserve.protocol.rooms import DState
from pdserve.protocol.sampling import SamplingParams
from pdserve.runtime.timing import PEER_ENGINE_STALL_S, PEER_TIMEOUT_S
from pdserve.worker.decode_rooms import DRoom
from pdserve.worker.prefill_pairing import PrefillPairing
from pdserve.worker.prefill_peers import PrefillPeers
from pdserve.worker.roles import RoleStats

P = "tcp://10.0.0.1:5000"
REGISTER = m.Register(layout={}, backend="shm")


class Harness:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []
        self.forgotten: list[str] = []
        self.stats = RoleStats()
        self.pairing = PrefillPairing(
            PrefillPeers(cap=4, idle_s=60.0),
            lambda address, msg: self.sent.append((address, type(msg).__name__)),
            lambda: REGISTER,
            self.forgotten.append,
            self.stats,
        )
        self.leases = Leases(PageAllocator(8))

    def room(self, rid: int) -> DRoom:
        req = Request(f"r{rid}", [1, 2, 3], SamplingParams(max_tokens=1), sink=lambda o: None)
        return DRoom(rid, 1, req, P, time.monotonic() + 60, self.leases.open(f"room {rid}"))


def test_rooms_wait_behind_one_register_and_go_once_it_is_acked():
    h = Harness()
    peer = h.pairing.open(P, busy=())
    assert h.pairing.join(peer, 1) is False and h.pairing.join(peer, 2) is False
    assert h.sent == [(P, "Register")]  # one Register in flight, both rooms queued on it
    assert h.pairing.acked(P, m.RegisterAck(ok=True)) == ([1, 2], None)
    assert h.pairing.join(peer, 3) is True and h.sent == [(P, "Register")]


def test_a_refusal_fails_the_queued_rooms_and_the_next_room_pairs_anew():
    h = Harness()
    peer = h.pairing.open(P, busy=())
    h.pairing.join(peer, 1)
    assert h.pairing.acked(P, m.RegisterAck(ok=False, error="dtype")) == ([1], "dtype")
    assert h.pairing.join(peer, 2) is False  # a fresh record: Register again
    assert h.sent == [(P, "Register"), (P, "Register")]
    assert h.pairing.peers.get(P) is not peer


def test_an_ack_from_an_address_never_asked_is_counted_and_ignored():
    h = Harness()
    assert h.pairing.acked("tcp://stranger:1", m.RegisterAck(ok=True)) == ([], None)
    assert h.stats.unexpected["RegisterAck"] == 1


def test_a_prefill_worker_that_forgot_us_is_registered_again_once_per_room():
    h = Harness()
    peer = h.pairing.open(P, busy=())
    h.pairing.join(peer, 1)
    h.pairing.acked(P, m.RegisterAck(ok=True))
    room = h.room(1)
    assert h.pairing.register_again(room) is True and not peer.registered
    assert h.pairing.register_again(room) is False  # the same room again: give up
    other = h.room(2)
    assert h.pairing.register_again(other) is True  # queued behind the Register in flight
    assert h.sent == [(P, "Register"), (P, "Register")] and peer.queued == [1, 2]
    accepted = h.room(3)
    accepted.state = DState.PREFILLING
    assert h.pairing.register_again(accepted) is False  # P accepted it: not a pairing matter


def test_a_pong_from_a_stalled_engine_does_not_prove_the_peer_alive():
    h = Harness()
    peer = h.pairing.open(P, busy=())
    peer.last_pong = 0.0
    now = time.time()
    h.pairing.heard(P, m.Pong(engine_busy_s=PEER_ENGINE_STALL_S + 1, ping_sent_at=now, sent_at=now))
    assert peer.last_pong == 0.0 and h.stats.stale["pong_engine_stalled"] == 1
    h.pairing.heard(P, m.PrefillAccept(room=1, epoch=1))  # any other word does
    assert peer.last_pong > 0.0


def test_a_silent_peer_with_rooms_waiting_is_declared_dead_and_an_idle_one_forgotten():
    h = Harness()
    peer = h.pairing.open(P, busy=())
    h.pairing.join(peer, 1)
    h.pairing.acked(P, m.RegisterAck(ok=True))
    room = h.room(1)
    later = time.monotonic() + PEER_TIMEOUT_S + 1
    assert h.pairing.liveness(later, {P: [room]}) == [P]
    assert (P, "Ping") in h.sent and peer.refused == "declared dead"
    h.pairing.evict_idle(time.monotonic() + 3600, busy=())
    assert h.forgotten == [P] and h.pairing.peers.get(P) is None
