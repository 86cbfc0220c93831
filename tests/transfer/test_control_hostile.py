"""The control plane against strangers and bad messages: dropped unread, threads unhurt."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from pdserve.protocol.messages import KVChunk, Msg, Ping, Register, encode
from pdserve.runtime.cluster_key import ClusterKey
from pdserve.runtime.supervisor import Supervisor
from pdserve.transfer.bulk import Bulk
from pdserve.transfer.control import Control, Inbound
from tests.helpers import join_as_member


def wait_until(pred: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class Side:
    def __init__(self, name: str, key: ClusterKey, raise_on: int | None = None) -> None:
        self.got: list[Msg] = []
        self.inbound: list[Inbound] = []
        self.failed: list[tuple[str, str]] = []
        self.raise_on = raise_on
        self.key = key
        self.control = Control(name, self.on_message, self.on_failed, key)

    def on_message(self, inbound: Inbound) -> None:
        if isinstance(inbound.msg, Ping) and inbound.msg.nonce == self.raise_on:
            raise RuntimeError("a handler bug")
        self.got.append(inbound.msg)
        self.inbound.append(inbound)

    def on_failed(self, peer: str, msg: Msg, why: str) -> None:
        self.failed.append((type(msg).__name__, why))

    def nonces(self) -> list[int]:
        return [m.nonce for m in self.got if isinstance(m, Ping)]


@pytest.fixture
def sides() -> Iterator[tuple[Side, Side, Supervisor]]:
    key = ClusterKey(secrets.token_bytes(32))
    p, d = Side("p-test", key, raise_on=13), Side("d-test", key)
    p.control.bind("127.0.0.1", 0)
    sup = Supervisor(restart_budget=0)
    sup.spawn("control-p", p.control.tick)
    sup.spawn("control-d", d.control.tick)
    try:
        yield p, d, sup
    finally:
        assert sup.stop(2.0) == []
        p.control.close()
        d.control.close()


def unhurt(sup: Supervisor) -> bool:
    return all(t["alive"] and t["crashes"] == 0 for t in sup.snapshot())


def test_a_stranger_is_refused_at_the_handshake(sides):
    """No member's handshake: a socket without one fails at ZMQ's greeting (no mechanism in
    common), one with another cluster's password is refused by P's control thread (ZAP); not
    one frame reaches Python, and a member still gets through."""
    p, d, sup = sides
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.setsockopt(zmq.IDENTITY, b"d-stranger")
    wrong = zmq.Context.instance().socket(zmq.DEALER)  # another cluster's handshake
    wrong.setsockopt(zmq.LINGER, 0)
    join_as_member(wrong, ClusterKey(secrets.token_bytes(32)))
    try:
        for sock in (stranger, wrong):
            sock.connect(p.control.address)  # the handshake is the connection's: no send needed
        wait_until(lambda: p.control.stats.dropped["handshake_refused"] >= 1)
        time.sleep(0.3)  # time for a frame that got through to show
        assert set(p.control.stats.dropped) == {"handshake_refused"}
        assert p.got == [] and p.control.stats.received == {}
        d.control.send(p.control.address, Ping(nonce=1))
        wait_until(lambda: p.nonces() == [1])
        assert unhurt(sup)
    finally:
        stranger.close(0)
        wrong.close(0)


def test_a_stranger_s_frames_are_dropped_unread(sides):
    """One past the handshake (PLAIN's password crosses the wire) without the frame key."""
    p, d, sup = sides
    ctx = zmq.Context.instance()
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.setsockopt(zmq.IDENTITY, b"d-stranger")
    join_as_member(stranger, p.key)
    stranger.connect(p.control.address)
    evil = Register(layout={}, backend="shm")
    try:
        stranger.send_multipart([encode(evil)])  # no auth frame at all
        stranger.send_multipart([b"\x00" * 80, encode(evil)])  # a forged one
        other = Side("d-stranger", ClusterKey(secrets.token_bytes(32)))  # another cluster's key
        stranger.send_multipart(other.control.auth.sign([encode(evil)]))
        other.control.close()
        wait_until(lambda: sum(dict(p.control.stats.dropped).values()) == 3)
        assert p.control.stats.dropped == {"auth_missing": 2, "auth_bad_mac": 1}
        assert p.got == [] and p.control.stats.received == {}
        d.control.send(p.control.address, Ping(nonce=1))  # a member still gets through
        wait_until(lambda: p.nonces() == [1])
        assert unhurt(sup)
    finally:
        stranger.close(0)


def test_a_message_that_cannot_be_encoded_fails_alone(sides):
    p, d, sup = sides
    d.control.send(p.control.address, Ping(nonce=2**70))  # msgpack has no such integer
    d.control.send(p.control.address, Ping(nonce=2))
    wait_until(lambda: p.nonces() == [2])
    assert d.failed and d.failed[0][0] == "Ping" and "cannot encode" in d.failed[0][1]
    assert d.control.stats.encode_failed == 1 and unhurt(sup)


def test_a_handler_that_raises_costs_one_message(sides):
    p, d, sup = sides
    for n in (12, 13, 14):
        d.control.send(p.control.address, Ping(nonce=n))
    wait_until(lambda: p.nonces() == [12, 14])
    assert p.control.stats.handler_errors == 1 and unhurt(sup)


def test_a_replayed_member_frame_is_dropped(sides):
    p, d, sup = sides
    signed = d.control.auth.sign([msgspec.msgpack.encode(Ping(nonce=7))])
    ctx = zmq.Context.instance()
    replayer = ctx.socket(zmq.DEALER)
    replayer.setsockopt(zmq.LINGER, 0)
    replayer.setsockopt(zmq.IDENTITY, b"d-test")  # d itself has not connected: no clash
    join_as_member(replayer, p.key)  # a capture of the handshake too
    replayer.connect(p.control.address)
    try:
        replayer.send_multipart(signed)
        replayer.send_multipart(signed)  # captured and sent again
        wait_until(lambda: p.control.stats.dropped.get("auth_replay") == 1)
        assert p.nonces() == [7] and unhurt(sup)
    finally:
        replayer.close(0)


def test_bulk_frames_cross_unchecked_and_unaltered():
    """P's KV pages reach D as bulk frames: D's control thread checks the MAC over the body
    and the digests only, and hands on ZMQ's own buffers, which match their digests. Frames
    after the body that the auth frame does not declare bulk are dropped unread. (Both
    controls are ticked here, on the test's thread, so that it may put raw frames on P's
    socket: a socket is its I/O thread's alone.)"""
    key = ClusterKey(secrets.token_bytes(32))
    p, d = Side("p-test", key), Side("d-test", key)
    p.control.bind("127.0.0.1", 0)

    def pump(pred: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10
        while not pred():
            assert time.monotonic() < deadline, "timed out"
            p.control.tick()
            d.control.tick()

    try:
        d.control.send(p.control.address, Ping(nonce=1))  # P learns D's identity
        pump(lambda: p.nonces() == [1])
        pages = [secrets.token_bytes(64 * 1024) for _ in range(3)]
        chunk = KVChunk(room=7, epoch=1, dst_pages=[4, 0, 2])
        p.control.send("d-test", chunk, Bulk.seal(pages))
        pump(lambda: bool(d.inbound))
        (got,) = d.inbound
        assert isinstance(got.msg, KVChunk) and got.bulk is not None
        assert got.bulk.sizes == [len(x) for x in pages]
        frames = got.bulk.frames()
        assert all(isinstance(f, memoryview) for f in frames)  # not copied out of ZMQ
        assert [bytes(f) for f in frames] == pages
        # A member's frame after the body, MACed whole but not declared bulk: dropped unread.
        p.control.send_raw("d-test", p.control.auth.sign([encode(Ping(nonce=2)), b"extra"]))
        p.control.send("d-test", Ping(nonce=3))
        pump(lambda: d.nonces() == [3])
        assert d.control.stats.dropped["unexpected_frames"] == 1
        # Bulk frames after any message but a KVChunk: nobody would read them, dropped.
        page = Bulk.seal([b"page"])
        signed = p.control.auth.sign([encode(Ping(nonce=4))], page.digests)
        p.control.send_raw("d-test", [*signed, b"page"])
        p.control.send("d-test", Ping(nonce=5))
        pump(lambda: d.nonces() == [3, 5])
        assert d.control.stats.dropped["unexpected_frames"] == 2
        # More bulk frames than the auth frame can count fail their send, saying why.
        p.control.send("d-test", chunk, Bulk.seal([b"x"] * 0x10000))
        p.control.tick()
        assert p.failed == [
            ("KVChunk", "cannot sign KVChunk: 'H' format requires 0 <= number <= 65535")
        ]
    finally:
        p.control.close()
        d.control.close()
