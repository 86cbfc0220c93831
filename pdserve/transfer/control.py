"""The control plane: ZMQ sockets owned by one I/O thread, typed messages in and out.

P binds a ROUTER socket; each D connects a DEALER (identity = D's worker id) per P it uses.
Only the I/O thread touches sockets. Other threads `send()` into a bounded queue and wake the
I/O thread through a pipe it polls with its sockets (a send goes out at once; an idle I/O
thread sleeps in poll instead of waking every few ms). The I/O thread sends without blocking
(a peer that does not drain fails that message, reported through `on_send_failed`, instead
of freezing a thread: LESSONS #5). A message that cannot be encoded fails the same way.

Every message is authenticated (transfer/frame_auth.py: an HMAC with the cluster key, fresh
and not replayed) before anything reads it; a message that fails is counted by why and dropped
unread (LESSONS #15). Its bulk frames (a KVChunk's pages, the only message that has them) are
covered by digests under that HMAC and are read only once each matches (transfer/bulk.py, on
D's stager thread), never here. What passes goes through the one decoder; what it cannot read
is counted and dropped (LESSONS #1). A handler that raises on a message is counted too; the
thread goes on. What comes in is bounded per message, per peer queue and per tick, so a flood
keeps neither the heartbeat nor the outbox waiting and no peer makes us allocate without bound
(transfer/control_limits.py, LESSONS #18), and a stranger does not get past ZMQ's handshake
at all (transfer/control_handshake.py: PLAIN with a password from the cluster key, whose ZAP
requests this thread answers, or CURVE).

Fault points `control.recv.<Type>` / `control.send.<Type>` (runtime/faults.py) are carried out
on the I/O thread, one `FaultedPath` a direction (transfer/control_faults.py); `tick` releases
what a `reorder` held for HOLD_S.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import zmq

from pdserve.protocol.messages import (
    DecodeError,
    KVChunk,
    Message,
    Msg,
    Unreadable,
    decode,
    encode,
)
from pdserve.runtime.cluster_key import ClusterKey
from pdserve.runtime.timing import DROP_LOG_EVERY_S, HOLD_S
from pdserve.transfer.bulk import Bulk, Frame
from pdserve.transfer.control_faults import FaultedPath
from pdserve.transfer.control_handshake import (
    ZAP_ENDPOINT,
    Handshake,
    HandshakeKeys,
    configured_handshake,
)
from pdserve.transfer.control_limits import (
    HANDSHAKE_IVL_MS,
    MAX_FRAME_BYTES,
    RECV_BATCH,
    RECV_BYTES,
    ROUTER_RCVHWM,
)
from pdserve.transfer.frame_auth import MAX_AUTH_BYTES, FrameAuth, InboundLimit

log = logging.getLogger(__name__)

POLL_MS = 100  # the I/O loop's longest sleep in poll (sends wake it; this bounds held messages)
OUTBOX_LIMIT = 10_000


@dataclass(frozen=True)
class Inbound:
    peer: str  # P: the D's identity; D: the P's address
    msg: Message | Unreadable
    bulk: Bulk | None = None  # KV page frames on the tcp backend, not checked yet (bulk.py)


Outgoing = tuple[str, Msg, Bulk | None]  # peer, message, bulk frames


@dataclass
class ControlStats:
    received: Counter[str] = field(default_factory=Counter)
    sent: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)  # auth and decode errors by kind
    send_failed: int = 0
    encode_failed: int = 0
    handler_errors: int = 0  # messages whose handler raised (the thread went on)

    def snapshot(self) -> dict[str, object]:
        return {
            "received": dict(self.received),
            "sent": dict(self.sent),
            "dropped": dict(self.dropped),
            "send_failed": self.send_failed,
            "encode_failed": self.encode_failed,
            "handler_errors": self.handler_errors,
        }


class Control:
    """`on_message(Inbound)` and `on_send_failed(peer, msg, why)` run on the I/O thread.

    `handshake`: how peers prove membership when they connect (None: as the environment says,
    control_handshake.configured_handshake)."""

    def __init__(
        self,
        identity: str,
        on_message: Callable[[Inbound], None],
        on_send_failed: Callable[[str, Msg, str], None],
        key: ClusterKey,
        handshake: Handshake | None = None,
    ) -> None:
        self.identity = identity
        self.auth = FrameAuth(key, identity)
        self.handshake = HandshakeKeys.derive(key, handshake or configured_handshake())
        # P: what one message from a decode worker may hold (set by bind). D: the most it may
        # send a prefill worker (set by limit_sends), so an oversized message fails here,
        # saying why, instead of P's ZMQ cutting the connection.
        self.inbound: InboundLimit | None = None
        self.max_send_bytes: int | None = None
        self._drop_logged: dict[str, float] = {}  # kind -> when a drop of it was last logged
        self.on_message = on_message
        self.on_send_failed = on_send_failed
        # A context of our own: its ZAP endpoint (P, PLAIN) is this Control's alone.
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.zap: zmq.Socket[bytes] | None = None  # P with PLAIN: ZMQ's questions about peers
        self.poller = zmq.Poller()
        self.router: zmq.Socket[bytes] | None = None
        self.dealers: dict[str, zmq.Socket[bytes]] = {}
        self.outbox: queue.Queue[Outgoing] = queue.Queue(OUTBOX_LIMIT)
        # Each direction through its fault points (transfer/control_faults.py).
        self.faults_in: FaultedPath[Inbound] = FaultedPath(self._dispatch, self._decode_junk)
        self.faults_out: FaultedPath[Outgoing] = FaultedPath(self._transmit, self._send_junk)
        self._forget: deque[str] = deque()  # dealers to close (D): see forget()
        self.stats = ControlStats()
        self.address = ""
        # send() writes a byte here to wake the I/O thread out of poll.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.poller.register(self._wake_r, zmq.POLLIN)

    def bind(self, host: str, port: int, max_message_bytes: int = MAX_FRAME_BYTES) -> str:
        """P: listen for decode workers, taking messages of at most `max_message_bytes`
        (control_limits.prefill_inbound_bytes); returns the bound address."""
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer -> error, not a silent drop
        s.setsockopt(zmq.SNDHWM, 1000)
        s.setsockopt(zmq.RCVHWM, ROUTER_RCVHWM)
        s.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        # Decode workers send [auth, body] only: ZMQ refuses a longer frame before reading it.
        s.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.inbound = InboundLimit(max_frames=2, max_bytes=max_message_bytes)
        if self.handshake.mode is Handshake.PLAIN:
            self.zap = self.ctx.socket(zmq.REP)
            self.zap.setsockopt(zmq.LINGER, 0)
            self.zap.bind(ZAP_ENDPOINT)
            self.poller.register(self.zap, zmq.POLLIN)
        self.handshake.serve(s)
        if port:
            s.bind(f"tcp://{host}:{port}")
        else:
            port = s.bind_to_random_port(f"tcp://{host}")
        self.router = s
        self.poller.register(s, zmq.POLLIN)
        self.address = f"tcp://{host}:{port}"
        return self.address

    def limit_sends(self, max_bytes: int) -> None:
        """D: fail a message to a prefill worker over `max_bytes` (P's inbound limit for the
        same model) with on_send_failed, before it goes out."""
        self.max_send_bytes = max_bytes

    # -- any thread -------------------------------------------------------------------------
    def send(self, peer: str, msg: Msg, bulk: Bulk | None = None) -> None:
        """Queue `msg` for `peer`, followed by `bulk`'s frames, which go out without a copy:
        their buffers must not change after this call."""
        try:
            self.outbox.put_nowait((peer, msg, bulk))
        except queue.Full:
            self.stats.send_failed += 1
            self.on_send_failed(peer, msg, "control outbox full")
            return
        self.wake()

    def forget(self, peer: str) -> None:
        """Close our socket to `peer` (a prefill worker D no longer pairs with) once the
        messages queued before this call are out. Any thread."""
        self._forget.append(peer)
        self.wake()

    def wake(self) -> None:
        """Make the I/O thread's poll return now (any thread)."""
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # full of wake-ups already (it will wake), or closed at shutdown
            pass

    # -- the I/O thread ----------------------------------------------------------------------
    def _dealer(self, address: str) -> zmq.Socket[bytes]:
        s = self.dealers.get(address)
        if s is None:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IDENTITY, self.identity.encode())
            s.setsockopt(zmq.SNDHWM, 1000)
            s.setsockopt(zmq.RECONNECT_IVL, 100)
            # An unreachable peer costs a reconnect every 5 s at most, not ten a second.
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
            s.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            self.handshake.connect_as_client(s)
            s.connect(address)
            self.poller.register(s, zmq.POLLIN)
            self.dealers[address] = s
        return s

    def tick(self) -> None:
        """Poll once, deliver a bounded share of what arrived on each socket, flush the
        outbox without blocking, then release messages a `reorder` fault has held for HOLD_S.
        What is left unread makes the next poll return at once."""
        for sock, _ in self.poller.poll(POLL_MS):
            if sock == self._wake_r:
                self._drain_wake()
            elif self.zap is not None and sock is self.zap:
                self._answer_zap(self.zap)
            else:
                self._read(sock)
        # At most what was queued when the flush began: a busy sender cannot hold the tick.
        for _ in range(self.outbox.qsize()):
            try:
                out = self.outbox.get_nowait()
            except queue.Empty:
                break
            self.faults_out.through(f"control.send.{type(out[1]).__name__}", out)
        while self._forget:
            dealer = self.dealers.pop(self._forget.popleft(), None)
            if dealer is not None:
                self.poller.unregister(dealer)
                dealer.close(0)
        too_old = time.monotonic() - HOLD_S
        self.faults_in.release_older(too_old)
        self.faults_out.release_older(too_old)

    def _read(self, sock: zmq.Socket[bytes]) -> None:
        """Read at most RECV_BATCH messages or RECV_BYTES bytes from `sock` (LESSONS #18)."""
        on_router = sock is self.router
        peer = "" if on_router else next(a for a, d in self.dealers.items() if d is sock)
        budget = RECV_BYTES
        for _ in range(RECV_BATCH):
            routing_id: str | None = None
            try:
                if on_router:  # a decode worker's messages: small, and never bulk
                    parts: list[Frame] = list(sock.recv_multipart(zmq.NOBLOCK))
                    peer, parts = bytes(parts[0]).decode(errors="replace"), parts[1:]
                    routing_id = peer
                else:  # a prefill worker's: KV page frames stay in ZMQ's buffers
                    got = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    parts = [f.bytes for f in got[:2]] + [f.buffer for f in got[2:]]
            except zmq.Again:
                return
            budget -= sum(map(len, parts))  # a refused message cost its hashing too
            refused = self.auth.check(routing_id, parts, self.inbound)
            if refused is not None:
                self._dropped(refused.value, peer, "not authenticated")
            else:
                self._deliver(peer, parts)
            if budget <= 0:
                return

    def _answer_zap(self, sock: zmq.Socket[bytes]) -> None:
        """Answer at most RECV_BATCH of ZMQ's "may this peer in?" questions (PLAIN); a
        refused peer is counted as `handshake_refused` and never sends us a frame."""
        for _ in range(RECV_BATCH):
            try:
                request = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply, ok = self.handshake.zap_reply(request)
            sock.send_multipart(reply)
            if not ok:
                peer = request[3].decode(errors="replace") if len(request) > 3 else "?"
                self._dropped("handshake_refused", peer, "no member's handshake")

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _decode(self, peer: str, body: bytes, bulk: Bulk | None = None) -> Inbound | None:
        """The one way in: None for a frame that cannot be read (counted, logged, dropped)."""
        msg = decode(body)
        if isinstance(msg, DecodeError):
            self._dropped(msg.kind, peer, msg.detail)
            if not msg.of:
                return None
            # It says what it is and which room: the role may answer it (a PrefillReject).
            what = Unreadable(room=msg.room, epoch=msg.epoch, of=msg.of, detail=msg.detail[:300])
            return Inbound(peer, what)
        self.stats.received[type(msg).__name__] += 1
        return Inbound(peer, msg, bulk)

    def _dropped(self, kind: str, peer: str, detail: str) -> None:
        """Count a frame dropped unread; log it, at most once per kind every few seconds."""
        self.stats.dropped[kind] += 1
        now = time.monotonic()
        if now - self._drop_logged.get(kind, -DROP_LOG_EVERY_S) >= DROP_LOG_EVERY_S:
            self._drop_logged[kind] = now
            log.warning(
                "dropped a control frame from %r: %s (%s); %d of this kind so far",
                peer[:80],
                kind,
                detail[:200],
                self.stats.dropped[kind],
            )

    def _dispatch(self, inbound: Inbound) -> None:
        """Hand a message to its handler; one that raises costs that message, not the thread."""
        try:
            self.on_message(inbound)
        except Exception as e:  # noqa: BLE001 - LESSONS #1: no message kills the I/O thread
            self.stats.handler_errors += 1
            log.warning(
                "control handler failed on %s from %s: %s: %s",
                type(inbound.msg).__name__,
                inbound.peer[:80],
                type(e).__name__,
                e,
            )

    def _deliver(self, peer: str, parts: list[Frame]) -> None:
        """An authenticated [auth, body, *bulk frames] to its handler, through the faults."""
        digests = FrameAuth.digests(bytes(parts[0]))
        if len(parts) < 2:
            self.stats.dropped["empty"] += 1
            return
        if len(parts) != 2 + len(digests):  # frames after the body that are not bulk
            self._dropped("unexpected_frames", peer, f"{len(parts) - 2} frames after the body")
            return
        bulk = Bulk.received(parts[2:], digests) if digests else None
        inbound = self._decode(peer, bytes(parts[1]), bulk)
        if inbound is None:
            return
        if bulk is not None and not isinstance(inbound.msg, KVChunk):  # nobody would read them
            self._dropped(
                "unexpected_frames", peer, f"bulk frames after a {type(inbound.msg).__name__}"
            )
            return
        self.faults_in.through(f"control.recv.{type(inbound.msg).__name__}", inbound)

    def _decode_junk(self, inbound: Inbound, frame: bytes) -> None:
        """A fault's frame in place of a received message: through the one decoder, no
        further (it is counted and dropped there)."""
        self._decode(inbound.peer, frame)

    def _transmit(self, out: Outgoing) -> None:
        peer, msg, bulk = out
        try:
            body = encode(msg)
        except Exception as e:  # noqa: BLE001 - OverflowError, TypeError, msgspec.EncodeError
            self.stats.encode_failed += 1
            self.on_send_failed(peer, msg, f"cannot encode {type(msg).__name__}: {e}")
            return
        limit = self.max_send_bytes
        if limit is not None and peer.startswith("tcp://") and len(body) + MAX_AUTH_BYTES > limit:
            self.stats.encode_failed += 1
            why = f"{type(msg).__name__} of {len(body)} bytes is over the peer's limit {limit}"
            self.on_send_failed(peer, msg, why)
            return
        try:
            parts: list[Frame]
            if bulk is None:
                parts = list(self.auth.sign([body]))
            else:  # the frames' buffers are the sender's, unchanged until sent: no copy
                parts = [*self.auth.sign([body], bulk.digests), *bulk.frames()]
        except (ValueError, struct.error) as e:  # more bulk frames than the auth frame counts
            self.stats.encode_failed += 1
            self.on_send_failed(peer, msg, f"cannot sign {type(msg).__name__}: {e}")
            return
        try:
            self.send_raw(peer, parts, bulk is None)
        except zmq.ZMQError as e:  # Again (peer not draining) or EHOSTUNREACH (gone)
            self.stats.send_failed += 1
            self.on_send_failed(peer, msg, f"send failed: {e}")
            return
        self.stats.sent[type(msg).__name__] += 1

    def _send_junk(self, out: Outgoing, frame: bytes) -> None:
        """A fault's frame in place of a message; the message is lost either way."""
        peer = out[0]
        try:
            self.send_raw(peer, self.auth.sign([frame]))  # a member's junk: it gets decoded
        except zmq.ZMQError as e:
            self.stats.send_failed += 1
            log.warning("could not send a fault-injected frame to %s: %s", peer, e)

    def send_raw(self, peer: str, parts: Sequence[Frame], copy: bool = True) -> None:
        """Put frames on the wire as they are, signed or not (I/O thread only); `copy=False`:
        ZMQ sends from the frames' own buffers. Raises zmq.ZMQError."""
        if self.router is not None and not peer.startswith("tcp://"):
            self.router.send_multipart([peer.encode(), *parts], zmq.NOBLOCK, copy=copy)
        else:
            self._dealer(peer).send_multipart(parts, zmq.NOBLOCK, copy=copy)

    def close(self) -> None:
        for s in [self.router, self.zap, *self.dealers.values()]:
            if s is not None:
                s.close(0)
        self.ctx.term()  # every socket is closed with linger 0: returns at once
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
