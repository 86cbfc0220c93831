"""A decode worker's prefill peers: at most MAX_PREFILL_PEERS, idle ones forgotten.

Every distinct prefill address a /generate call names becomes a peer, and the control plane
opens a ZMQ DEALER to it that reconnects forever, unreachable or not. Unbounded, a caller
naming new addresses would grow a socket per call and the CPU spent reconnecting them. So:

* a peer is **busy** while a room or a Register uses it, else **idle** since it was last used;
* `evict_idle` forgets peers idle for PEER_IDLE_S (the decode role then asks the control plane
  to close their sockets); a peer that comes back later simply pairs again;
* `open` on a new address when the set is full first forgets the peer idle the longest; if
  every peer is busy it raises PeerLimit, and only that request fails, saying why.

Sans-I/O and owned by the engine thread, like the rest of the decode role.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

from pdserve.runtime.timing import PEER_IDLE_S
from pdserve.worker.decode_rooms import PrefillPeer

MAX_PREFILL_PEERS = 64  # prefill workers one decode worker pairs with at once


class PeerLimit(ValueError):
    """Every one of the decode worker's MAX_PREFILL_PEERS peers is busy."""


class PrefillPeers:
    def __init__(self, cap: int = MAX_PREFILL_PEERS, idle_s: float = PEER_IDLE_S) -> None:
        if cap < 1 or not idle_s > 0:
            raise ValueError(f"need cap >= 1 and idle_s > 0, got {cap}, {idle_s}")
        self.cap, self.idle_s = cap, idle_s
        self._peers: dict[str, PrefillPeer] = {}
        self._used: dict[str, float] = {}  # address -> when a room or Register last used it
        self.evicted = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._peers)

    def __iter__(self) -> Iterator[PrefillPeer]:
        return iter(list(self._peers.values()))

    def get(self, address: str) -> PrefillPeer | None:
        return self._peers.get(address)

    def open(
        self, address: str, now: float, busy: Collection[str]
    ) -> tuple[PrefillPeer, list[str]]:
        """The peer at `address`, made if new; and the addresses forgotten to make room (close
        their sockets). `busy`: addresses with open rooms. Raises PeerLimit."""
        self._used[address] = now
        peer = self._peers.get(address)
        if peer is not None:
            return peer, []
        forgotten: list[str] = []
        if len(self._peers) >= self.cap:
            idle = [a for a in self._peers if not self._busy(a, busy)]
            if not idle:
                self.refused += 1
                del self._used[address]
                raise PeerLimit(
                    f"this decode worker already pairs with {self.cap} prefill workers, all "
                    f"busy (its limit); {address} is refused"
                )
            oldest = min(idle, key=lambda a: self._used.get(a, 0.0))
            self._forget(oldest)
            forgotten.append(oldest)
        peer = self._peers[address] = PrefillPeer(address)
        return peer, forgotten

    def replace(self, address: str) -> PrefillPeer:
        """A fresh record for a known address (after it refused us or was declared dead)."""
        if address not in self._peers:
            raise KeyError(address)
        peer = self._peers[address] = PrefillPeer(address)
        return peer

    def evict_idle(self, now: float, busy: Collection[str]) -> list[str]:
        """Forget every peer idle for `idle_s`; returns their addresses (close their sockets)."""
        stale = [
            a
            for a in self._peers
            if not self._busy(a, busy) and now - self._used.get(a, now) > self.idle_s
        ]
        for a in stale:
            self._forget(a)
        return stale

    def _busy(self, address: str, busy: Collection[str]) -> bool:
        return address in busy or bool(self._peers[address].queued)

    def _forget(self, address: str) -> None:
        del self._peers[address]
        self._used.pop(address, None)
        self.evicted += 1

    def snapshot(self) -> dict[str, int]:
        return {
            "peers": len(self._peers),
            "cap": self.cap,
            "evicted": self.evicted,
            "refused": self.refused,
        }
