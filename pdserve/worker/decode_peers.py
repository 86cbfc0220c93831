"""A prefill worker's decode peers: pairing on Register, one writer each, dropping them.

A peer is paired when its Register message checks out (same KV layout; the data plane it
names can be opened: its shm pool, its control socket, its NIXL agent). `generation` numbers
each pairing: the same decode worker may register again (after it declared this P dead), and
a write that fails for an earlier pairing must not drop the current one. A dropped peer's
writer is closed CLOSE_AFTER_S later, after the engine's ticks (`tick`) let UCX fail what it
still had queued for that peer: tearing a UCX endpoint down with requests queued can abort
the process. Owned by the prefill engine thread, like everything it touches.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPool, ShmRef
from pdserve.protocol import messages as m
from pdserve.transfer.control import Control
from pdserve.transfer.copier import Copier
from pdserve.transfer.dataplane import PeerWriter, ShmWriter, TcpWriter
from pdserve.transfer.nixl import NixlAgent, NixlWriter

CLOSE_AFTER_S = 2.0  # a dropped peer's writer is closed this much later
PEER_SILENCE_S = 15.0  # a decode worker silent this long (it pings every second) is dead


@dataclass
class DecodePeer:
    identity: str
    writer: PeerWriter
    num_pages: int
    generation: int  # which pairing: the same D may register again
    last_seen: float = field(default_factory=time.monotonic)


class DecodePeers:
    def __init__(self, pool: KVPool, control: Control, copier: Copier | None) -> None:
        self.pool = pool
        self.control = control
        self.copier = copier
        self.by_id: dict[str, DecodePeer] = {}
        self.nixl: NixlAgent | None = None  # created on the first nixl registration
        self.pairings = 0
        self.closing: deque[tuple[float, PeerWriter]] = deque()  # (close at, writer), oldest first

    def __iter__(self) -> Iterator[DecodePeer]:
        return iter(list(self.by_id.values()))

    def get(self, identity: str) -> DecodePeer | None:
        return self.by_id.get(identity)

    def current(self, identity: str, generation: int) -> DecodePeer | None:
        """The peer, if `generation` is still its pairing."""
        peer = self.by_id.get(identity)
        return peer if peer is not None and peer.generation == generation else None

    def register(self, identity: str, msg: m.Register) -> DecodePeer:
        """Pair with a decode worker; raises (ValueError, OSError, NIXL's errors) saying why not."""
        ours = self.pool.layout
        theirs = KVLayout.from_dict(dict(msg.layout))
        diff = ours.mismatch(theirs, ours="prefill", theirs="decode")
        if diff is not None:
            raise ValueError(f"KV layout mismatch, {diff} (prefill vs decode)")
        writer: PeerWriter
        if msg.backend == "shm":
            if msg.shm is None:
                raise ValueError("backend shm needs the decode pool's shm reference")
            ref = ShmRef(msg.shm.pid, msg.shm.fd, msg.shm.token)
            writer = ShmWriter(ref, theirs, msg.num_pages, self.copier)
        elif msg.backend == "tcp":
            writer = TcpWriter(self.control, identity, self.control.identity, self.copier)
        elif msg.backend == "nixl":
            if msg.nixl is None:
                raise ValueError("backend nixl needs the decode pool's NIXL descriptor")
            if self.nixl is None:
                self.nixl = NixlAgent(self.control.identity, self.pool)
            old = self.by_id.pop(identity, None)
            if old is not None:  # the same D again: NIXL holds one remote agent per name, so
                old.writer.close()  # the old one must go before it is loaded anew (no delay)
            writer = NixlWriter(self.nixl, msg.nixl, theirs, msg.num_pages)
        else:
            raise ValueError(f"unknown backend {msg.backend!r}")
        self.pairings += 1
        peer = self.by_id[identity] = DecodePeer(identity, writer, msg.num_pages, self.pairings)
        return peer

    def drop(self, peer: DecodePeer) -> None:
        """Forget the peer now; its writer is closed CLOSE_AFTER_S later (see the header)."""
        del self.by_id[peer.identity]
        self.closing.append((time.monotonic() + CLOSE_AFTER_S, peer.writer))

    def silent(self, now: float) -> list[DecodePeer]:
        return [p for p in self.by_id.values() if now - p.last_seen > PEER_SILENCE_S]

    def tick(self) -> None:
        """Every engine tick: drive UCX (no progress thread of its own), retry handle
        releases NIXL refused, close the writers of peers dropped long enough ago."""
        if self.nixl is not None:
            self.nixl.progress()
            self.nixl.retry_releases()
        now = time.monotonic()
        while self.closing and self.closing[0][0] <= now:
            self.closing.popleft()[1].close()
