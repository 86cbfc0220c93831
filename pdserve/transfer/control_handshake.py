"""How a control socket's peer proves it is a member at ZMQ's handshake: strangers never
reach a queue.

Frame authentication (transfer/frame_auth.py) makes a stranger's frames useless, but only
after ZMQ has taken them in: ZMQ queues a multipart message whole before the socket can read
any of it, and MAXMSGSIZE bounds each frame, not their number, so one raw TCP connection
that keeps sending frames marked "more" grows a prefill worker's memory without bound (2.7
GB in 4 s on loopback) while nothing above ZMQ sees a byte (LESSONS #18). So the handshake
itself proves membership, keyed from the cluster key, in one of two ways:

* PLAIN (the default): a decode worker presents a password derived from the cluster key (the
  `zmq-plain` sub-key); P's control thread answers ZMQ's authentication requests (ZAP) on an
  inproc socket it polls with the others (`zap_reply`), so no thread is added. It costs
  nothing per frame, and a stranger is refused before its first message. The password
  crosses the wire in clear at each connection, like the workers' HTTP token: someone who
  can read the cluster's traffic learns it (docs/security.md); the frame MAC still refuses
  anything they send.
* CURVE (PDSERVE_CONTROL_CURVE=1 on every worker): CurveZMQ with key pairs derived from the
  `zmq-curve-server` / `zmq-curve-client` sub-keys. The server's public key is never sent
  (the client must know it beforehand), so only members complete the handshake, and no ZAP
  handler is needed. It also encrypts every frame, the tcp backend's KV pages included, which
  costs (benchmarks/transfer/control_curve.py); so it is the choice against a network that can be
  read, not the default.

Frame authentication stays on top either way: it names the sender and refuses replays.
Every member of a cluster must use the same handshake, as it must the same key.
"""

from __future__ import annotations

import enum
import hmac
import os
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from pdserve.runtime.cluster_key import ClusterKey

CURVE_ENV = "PDSERVE_CONTROL_CURVE"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks, in the socket's context
ZAP_DOMAIN = b"pdserve"
PLAIN_USER = b"pdserve"


class Handshake(enum.Enum):
    PLAIN = "plain"
    CURVE = "curve"


def configured_handshake() -> Handshake:
    """This process's handshake: CURVE with PDSERVE_CONTROL_CURVE=1, else PLAIN."""
    return Handshake.CURVE if os.environ.get(CURVE_ENV, "") == "1" else Handshake.PLAIN


@dataclass(frozen=True)
class HandshakeKeys:
    """A member's handshake credentials, derived from the cluster key (Z85 for CURVE, as
    ZMQ's socket options take them)."""

    mode: Handshake
    password: bytes
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:  # never print a secret
        return f"HandshakeKeys({self.mode.value}, <secret>)"

    @classmethod
    def derive(cls, key: ClusterKey, mode: Handshake) -> HandshakeKeys:
        # Any 32 bytes are a Curve25519 secret key (the scalar is clamped when used).
        server_secret = z85.encode(key.derive("zmq-curve-server"))
        client_secret = z85.encode(key.derive("zmq-curve-client"))
        return cls(
            mode=mode,
            password=z85.encode(key.derive("zmq-plain")),
            server_public=zmq.curve_public(server_secret),
            server_secret=server_secret,
            client_public=zmq.curve_public(client_secret),
            client_secret=client_secret,
        )

    def serve(self, sock: zmq.Socket[bytes]) -> None:
        """Make `sock` (P's ROUTER, before bind) accept only members. PLAIN needs a ZAP
        handler in the socket's context (`zap_reply`, polled by the control thread)."""
        if self.mode is Handshake.CURVE:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        else:
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler: refused, not let in

    def connect_as_client(self, sock: zmq.Socket[bytes]) -> None:
        """Make `sock` (a DEALER, before connect) a member to a prefill worker's ROUTER."""
        if self.mode is Handshake.CURVE:
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)
        else:
            sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USER)
            sock.setsockopt(zmq.PLAIN_PASSWORD, self.password)

    def zap_reply(self, request: list[bytes]) -> tuple[list[bytes], bool]:
        """The answer to one ZAP request (RFC 27: version, request id, domain, address,
        identity, mechanism, credentials...) and whether it let the peer in: only PLAIN with
        the member's user and password, in our domain."""
        version, request_id = (request + [b"", b""])[:2]
        ok = (
            len(request) == 8
            and version == b"1.0"
            and request[2] == ZAP_DOMAIN
            and request[5] == b"PLAIN"
            and request[6] == PLAIN_USER
            and hmac.compare_digest(request[7], self.password)
        )
        status = (b"200", b"OK") if ok else (b"400", b"not a member of this cluster")
        return [b"1.0", request_id, *status, PLAIN_USER if ok else b"", b""], ok
