"""A prefill worker's control port under floods (LESSONS #18): real sockets on 127.0.0.1.

Strangers flood P's ROUTER from processes of their own while a member pings it: the I/O
loop must keep its heartbeat fresh and answer the member, because it reads a bounded share
per tick (the flooders past the handshake, as one who learned PLAIN's password would be). A
frame over P's limit must never be hashed (ZMQ drops it before Python sees it, and FrameAuth
refuses an oversized message by its size alone). A stranger must not get past ZMQ's
handshake at all, PLAIN or CURVE.
"""

from __future__ import annotations

import secrets
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from pdserve.protocol.messages import Msg, Ping, Pong, PrefillRequest, encode
from pdserve.runtime.cluster_key import ClusterKey
from pdserve.runtime.supervisor import Supervisor
from pdserve.transfer import control
from pdserve.transfer.control import Control, Inbound
from pdserve.transfer.control_handshake import Handshake
from pdserve.transfer.control_limits import MAX_FRAME_BYTES, prefill_inbound_bytes
from pdserve.transfer.frame_auth import MAX_IDENTITY, FrameAuth, InboundLimit, Refusal
from tests.helpers import join_as_member

FLOOD_S = 3.0
# A stranger, for argv[2] seconds as fast as ZMQ takes them, to argv[1]: 1-byte frames, and
# every other process messages that look signed (right size and magic, a MAC of zeros) with a
# 32 KiB body that P must hash before it can refuse them: more than P's loop can read.
FLOODER = """
import sys, time, zmq
from pdserve.transfer.frame_auth import _HEAD, MAC_LEN, MAGIC
s = zmq.Context().socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
ident = b"stranger-" + sys.argv[3].encode()
s.setsockopt(zmq.IDENTITY, ident)
if sys.argv[4]:  # PLAIN's password: past the handshake
    s.setsockopt(zmq.PLAIN_USERNAME, b"pdserve")
    s.setsockopt(zmq.PLAIN_PASSWORD, sys.argv[4].encode())
s.connect(sys.argv[1])
head = _HEAD.pack(MAGIC, bytes(16), 1, time.time(), 0) + bytes(MAC_LEN) + ident
parts = [b"x"] if sys.argv[3] == "0" else [head, zmq.Frame(bytes(32768))]
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    try:
        s.send_multipart(parts, zmq.NOBLOCK, copy=False)
    except zmq.Again:
        time.sleep(0.001)
"""


def wait_until(pred: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class Peers:
    """P (binds, answers every Ping with a Pong through its outbox) and D, each ticked by a
    supervised thread as in a worker."""

    def __init__(self, handshake: Handshake, max_message_bytes: int = MAX_FRAME_BYTES) -> None:
        self.key = ClusterKey(secrets.token_bytes(32))
        self.pings: list[int] = []
        self.pongs: list[int] = []
        self.p = Control("p-test", self._on_p, self._failed, self.key, handshake=handshake)
        self.p.bind("127.0.0.1", 0, max_message_bytes)
        self.d = Control("d-test", self._on_d, self._failed, self.key, handshake=handshake)
        self.sup = Supervisor(restart_budget=0)
        self.sup.spawn("control-p", self.p.tick)
        self.sup.spawn("control-d", self.d.tick)

    def _on_p(self, inbound: Inbound) -> None:
        if isinstance(inbound.msg, Ping):
            self.pings.append(inbound.msg.nonce)
            self.p.send(inbound.peer, Pong(nonce=inbound.msg.nonce))

    def _on_d(self, inbound: Inbound) -> None:
        if isinstance(inbound.msg, Pong):
            self.pongs.append(inbound.msg.nonce)

    def _failed(self, peer: str, msg: Msg, why: str) -> None:
        raise AssertionError(f"send of {type(msg).__name__} to {peer} failed: {why}")

    def heartbeat_age(self) -> float:
        return next(t["heartbeat_age_s"] for t in self.sup.snapshot() if t["name"] == "control-p")

    def unhurt(self) -> bool:
        return all(t["alive"] and t["crashes"] == 0 for t in self.sup.snapshot())

    def close(self) -> None:
        assert self.sup.stop(2.0) == []
        self.p.close()
        self.d.close()


@pytest.fixture
def make_peers() -> Iterator[Callable[..., Peers]]:
    made: list[Peers] = []

    def make(handshake: Handshake, max_message_bytes: int = MAX_FRAME_BYTES) -> Peers:
        made.append(Peers(handshake, max_message_bytes))
        return made[-1]

    yield make
    for peers in made:
        peers.close()


@pytest.fixture
def flooders() -> Iterator[Callable[[str, bytes], None]]:
    """Start two stranger processes flooding an address (with PLAIN's password, if not empty);
    stopped by their pids at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(address: str, password: bytes) -> None:
        for n in range(2):
            argv = [sys.executable, "-c", FLOODER, address, str(FLOOD_S), str(n), password.decode()]
            procs.append(subprocess.Popen(argv))

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(5.0)


def ping_through_flood(peers: Peers) -> float:
    """Ping P every 50 ms for the flood's length; the oldest heartbeat P's loop showed."""
    worst = 0.0
    end = time.monotonic() + FLOOD_S
    nonce = 0
    while time.monotonic() < end:
        nonce += 1
        peers.d.send(peers.p.address, Ping(nonce=nonce))
        worst = max(worst, peers.heartbeat_age())
        time.sleep(0.05)
    wait_until(lambda: len(peers.pongs) == nonce)  # every Ping answered, the flood or not
    assert peers.pongs == list(range(1, nonce + 1))
    return worst


@pytest.mark.process
def test_a_stranger_flood_leaves_the_loop_turning(make_peers, flooders):
    peers = make_peers(Handshake.PLAIN)
    flooders(peers.p.address, peers.p.handshake.password)
    wait_until(lambda: peers.p.stats.dropped["auth_missing"] > 1000)  # the flood reaches us
    wait_until(lambda: peers.p.stats.dropped["auth_bad_mac"] > 100)
    worst = ping_through_flood(peers)
    assert worst < 2.0, f"P's control heartbeat went {worst:.2f}s without a tick"
    assert peers.p.stats.received == {"Ping": len(peers.pings)} and peers.unhurt()


def test_one_tick_reads_a_bounded_share(make_peers):
    """However much is queued, one tick reads at most RECV_BATCH messages from a socket."""
    peers = make_peers(Handshake.PLAIN)
    assert peers.sup.stop(2.0) == []  # tick by hand from here
    peers.sup = Supervisor(restart_budget=0)
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    join_as_member(stranger, peers.key)
    stranger.connect(peers.p.address)
    try:
        stranger.send(b"x")  # the handshake needs P's ticks (its ZAP answer): one through first
        wait_until(lambda: peers.p.tick() or peers.p.stats.dropped["auth_missing"] == 1)
        for _ in range(3 * control.RECV_BATCH):
            stranger.send(b"x")
        wait_until(lambda: bool(peers.p.router and peers.p.router.poll(0)))
        time.sleep(0.2)  # let all of them arrive
        peers.p.tick()
        assert peers.p.stats.dropped["auth_missing"] == 1 + control.RECV_BATCH
        while peers.p.stats.dropped["auth_missing"] < 1 + 3 * control.RECV_BATCH:
            peers.p.tick()  # the rest: the next polls return at once
    finally:
        stranger.close(0)


def test_a_frame_over_the_limit_is_never_hashed(make_peers, monkeypatch):
    peers = make_peers(Handshake.PLAIN, max_message_bytes=64 * 1024)
    hashed: list[int] = []
    real_mac = peers.p.auth._mac

    def counting_mac(sender: bytes, head: bytes, frames: list[bytes], digests: bytes) -> bytes:
        hashed.append(sum(map(len, frames)))
        return real_mac(sender, head, frames, digests)

    monkeypatch.setattr(peers.p.auth, "_mac", counting_mac)
    member = zmq.Context.instance().socket(zmq.DEALER)
    member.setsockopt(zmq.LINGER, 0)
    member.setsockopt(zmq.IDENTITY, b"d-big")
    join_as_member(member, peers.key)
    member.connect(peers.p.address)
    try:
        big = FrameAuth(peers.key, "d-big").sign([bytes(2**20)])  # signed, but 1 MiB
        member.send_multipart(big)
        peers.d.send(peers.p.address, Ping(nonce=1))
        wait_until(lambda: peers.pongs == [1])
        time.sleep(0.2)
        # ZMQ refused the frame while reading its length: it never reached Python.
        assert max(hashed) < 64 * 1024 and peers.p.stats.dropped == {}
    finally:
        member.close(0)


def test_frame_auth_refuses_by_size_before_hashing(monkeypatch):
    key = ClusterKey(secrets.token_bytes(32))
    d, p = FrameAuth(key, "decode-1"), FrameAuth(key, "prefill-1")
    hashed: list[int] = []
    real_mac = p._mac
    monkeypatch.setattr(p, "_mac", lambda *a: hashed.append(1) or real_mac(*a))
    limit = InboundLimit(max_frames=2, max_bytes=4096)
    assert p.check("decode-1", d.sign([bytes(5000)]), limit) is Refusal.TOO_LARGE
    assert p.check("decode-1", d.sign([b"body", b"page"]), limit) is Refusal.TOO_LARGE
    assert hashed == []
    assert p.check("decode-1", d.sign([b"body"]), limit) is None and hashed == [1]


def test_the_limit_fits_the_largest_prefill_request():
    context = 4096
    limit = prefill_inbound_bytes(context)
    worst = PrefillRequest(
        room=2**63 - 1,
        epoch=2**63 - 1,
        sender="d" * MAX_IDENTITY,
        prompt_ids=[2**63 - 1] * context,
        dst_pages=[2**63 - 1] * context,
        params={"temperature": 0.5, "stop_token_ids": [2**31] * 1024},
        write_deadline=time.time(),
    )
    signed = FrameAuth(ClusterKey(secrets.token_bytes(32)), "d" * MAX_IDENTITY).sign(
        [encode(worst)]
    )
    assert sum(map(len, signed)) <= limit < 2 * 2**20  # a few MB, not 256 MiB
    assert prefill_inbound_bytes(10**9) == MAX_FRAME_BYTES  # an absurd context: the old cap


def test_d_fails_a_message_over_p_s_limit_itself():
    key = ClusterKey(secrets.token_bytes(32))
    failed: list[tuple[str, str]] = []
    d = Control("d-test", lambda i: None, lambda p, m, why: failed.append((p, why)), key)
    try:
        d.limit_sends(prefill_inbound_bytes(16))
        request = PrefillRequest(prompt_ids=[1] * 2**21, dst_pages=[], params={}, write_deadline=0)
        d.send("tcp://127.0.0.1:9", request)
        d.tick()
        assert len(failed) == 1 and "over the peer's limit" in failed[0][1]
    finally:
        d.close()


def zmtp_null_greeting() -> bytes:
    """What a ZMTP 3.0 peer without CURVE says first (signature, version, NULL mechanism)."""
    return b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)


@pytest.mark.process
@pytest.mark.parametrize("handshake", list(Handshake))
def test_a_stranger_never_reaches_python(make_peers, flooders, handshake):
    peers = make_peers(handshake)
    flooders(peers.p.address, b"")
    host, port = peers.p.address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5.0) as raw:
        deadline = time.monotonic() + 5.0
        try:
            raw.sendall(zmtp_null_greeting())
            raw.sendall(b"\x04\x1c\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER")
            while raw.recv(4096):  # the server's greeting, then the end: it hung up on us
                assert time.monotonic() < deadline, "P kept talking to a stranger"
        except ConnectionError:
            pass  # or reset the connection: hung up all the same
    other_key = ClusterKey(secrets.token_bytes(32))
    other = Control("d-other", lambda i: None, lambda *a: None, other_key, handshake=handshake)
    try:
        other.send(peers.p.address, Ping(nonce=99))  # another cluster's handshake
        other.tick()
        worst = ping_through_flood(peers)
        assert worst < 2.0 and peers.unhurt()
        assert 99 not in peers.pings
        # Nothing got that far; PLAIN counts the wrong password P's control thread refused.
        if handshake is Handshake.CURVE:
            assert peers.p.stats.dropped == {}
        else:
            assert set(peers.p.stats.dropped) == {"handshake_refused"}
    finally:
        other.close()
