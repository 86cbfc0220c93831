"""A decode worker's prefill peers stay bounded (worker/decode/peers.py).

(Here rather than under a worker test package: the module is sans-I/O and needs no process.)
"""

from __future__ import annotations

import pytest

from pdserve.worker.decode.peers import PeerLimit, PrefillPeers

A, B, C = "tcp://10.0.0.1:5000", "tcp://10.0.0.2:5000", "tcp://10.0.0.3:5000"


def test_a_known_address_is_the_same_peer_and_a_new_one_is_made():
    peers = PrefillPeers(cap=2, idle_s=60.0)
    a, gone = peers.open(A, 0.0, busy=())
    assert gone == [] and peers.open(A, 1.0, busy=())[0] is a and len(peers) == 1
    assert peers.get(B) is None


def test_past_the_cap_the_longest_idle_peer_is_forgotten_for_a_new_one():
    peers = PrefillPeers(cap=2, idle_s=60.0)
    peers.open(A, 0.0, busy=())
    peers.open(B, 1.0, busy=())
    peers.open(A, 2.0, busy=())  # A used again: B is now the longest idle
    c, gone = peers.open(C, 3.0, busy=())
    assert gone == [B] and peers.get(B) is None and peers.get(C) is c and len(peers) == 2
    assert peers.snapshot() == {
        "peers": 2,
        "cap": 2,
        "evicted": 1,
        "refused": 0,
        "unproven": 2,
        "unproven_refused": 0,
    }


def test_past_the_cap_with_every_peer_busy_the_new_address_is_refused_and_nothing_leaks():
    peers = PrefillPeers(cap=2, idle_s=60.0)
    peers.open(A, 0.0, busy=())
    b, _ = peers.open(B, 0.0, busy=())
    b.queued.append(7)  # a room waits for B's RegisterAck: busy too
    with pytest.raises(PeerLimit, match="2 prefill workers, all busy"):
        peers.open(C, 1.0, busy={A})
    assert {p.address for p in peers} == {A, B} and peers.refused == 1
    b.queued.clear()
    assert peers.open(C, 2.0, busy={A})[1] == [B]  # B idle now: it makes room


def test_idle_peers_are_evicted_and_busy_ones_kept():
    peers = PrefillPeers(cap=8, idle_s=10.0)
    peers.open(A, 0.0, busy=())
    peers.open(B, 0.0, busy=())
    peers.open(C, 5.0, busy=())
    assert peers.evict_idle(10.5, busy={B}) == [A]  # B has rooms; C is not idle long enough
    assert peers.evict_idle(15.5, busy=set()) == [B, C]
    assert len(peers) == 0 and peers.evicted == 3


def test_replace_gives_a_fresh_record_for_a_known_address():
    peers = PrefillPeers()
    a, _ = peers.open(A, 0.0, busy=())
    a.refused = "declared dead"
    fresh = peers.replace(A)
    assert fresh is not a and fresh.refused is None and peers.get(A) is fresh
    with pytest.raises(KeyError):
        peers.replace(B)
