"""ZMQ CURVE on the control plane, keyed from the cluster key: strangers fail the handshake.

Frame authentication (transfer/frame_auth.py) makes a stranger's frames useless, but only
after ZMQ has taken them in: ZMQ queues a multipart message whole before the socket can
read any of it, and MAXMSGSIZE bounds each frame, not their number, so one raw TCP
connection that keeps sending frames marked "more" grows a prefill worker's memory without
bound (2.7 GB in 4 s on loopback) while nothing above ZMQ sees a byte. With CURVE the ZMQ
handshake itself proves membership, so a stranger's bytes never reach a queue.

The keys are derived, never configured: every member computes the same server key pair from
the cluster key's `zmq-curve-server` sub-key, and the same client key pair from
`zmq-curve-client`. The server's public key is never sent (CurveZMQ's client must know it
beforehand), so here it is a secret of the cluster like the key it comes from: a client
completes the handshake only if it knows it. No ZAP handler runs; a prefill worker accepts
any client that completed the handshake, and a decode worker knows its prefill worker is a
member too (only the server secret opens the client's HELLO). Frame authentication stays
on top: it names the sender and refuses replays, which CURVE does only per connection.

CURVE encrypts every frame on ZMQ's I/O thread, KV pages of the tcp backend included;
benchmarks/control_flood.py --curve-cost measures what that costs.

On when PDSERVE_CONTROL_CURVE=1 in the environment (inherited by a worker's engine process);
every member of a cluster must agree, as they must on the key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from pdserve.runtime.cluster_key import ClusterKey

CURVE_ENV = "PDSERVE_CONTROL_CURVE"


def curve_enabled() -> bool:
    """Whether this process's control sockets speak CURVE (PDSERVE_CONTROL_CURVE=1)."""
    return os.environ.get(CURVE_ENV, "") == "1"


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded CURVE keys, as ZMQ's socket options take them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:  # never print a secret
        return "CurveKeys(<secret>)"

    @classmethod
    def derive(cls, key: ClusterKey) -> CurveKeys:
        # Any 32 bytes are a Curve25519 secret key (the scalar is clamped when used).
        server_secret = z85.encode(key.derive("zmq-curve-server"))
        client_secret = z85.encode(key.derive("zmq-curve-client"))
        return cls(
            server_public=zmq.curve_public(server_secret),
            server_secret=server_secret,
            client_public=zmq.curve_public(client_secret),
            client_secret=client_secret,
        )

    def serve(self, sock: zmq.Socket[bytes]) -> None:
        """Make `sock` (P's ROUTER, before bind) accept only clients holding the keys."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)

    def connect_as_client(self, sock: zmq.Socket[bytes]) -> None:
        """Make `sock` (D's DEALER, before connect) a client of a member's ROUTER."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)
