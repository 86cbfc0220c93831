"""A decode worker's prefill peers: at most MAX_PREFILL_PEERS, idle ones forgotten.

Every distinct prefill address a /generate call names becomes a peer, and the control plane
opens a ZMQ DEALER to it that reconnects forever, unreachable or not. Unbounded, a caller
naming new addresses would grow a socket per call and the CPU spent reconnecting them. So:

* a peer is **busy** while a room or a Register uses it, else **idle** since it was last used;
* `evict_idle` forgets peers idle for `idle_s` (the decode role then asks the control plane
  to close their sockets); a peer that comes back later simply pairs again;
* `open` on a new address when the set is full first forgets the peer idle the longest; if
  every peer is busy it raises PeerLimit, and only that request fails, saying why;
* `liveness` says whom to ping (every `ping_every_s` while it is registered, or proven with
  rooms waiting on it) and who is dead: silent for `peer_timeout_s` while rooms wait on it.

An address is only a claim until the peer proves it holds the cluster key (its HelloAck:
worker/decode/pairing.py). Whoever can call /generate could name any host, so unproven
addresses are bounded: at most MAX_UNPROVEN at once, never pinged, and one that failed to
prove itself (declared dead before its HelloAck) is refused for `unproven_backoff_s`. An address
that proved itself once is exempt from the backoff: a real prefill worker that restarts or
stalls is paired again as soon as it answers.

Sans-I/O and owned by the engine thread, like the rest of the decode role: the caller passes
`now`, and the bounds are a `PdTiming` (runtime/timing.py).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

from pdserve.runtime.timing import PD_TIMING, PdTiming
from pdserve.worker.decode.rooms import PrefillPeer

MAX_PREFILL_PEERS = 64  # prefill workers one decode worker pairs with at once
MAX_UNPROVEN = 8  # peers at once whose HelloAck has not come yet
MAX_REMEMBERED = 1024  # proven and failed addresses remembered, each (the oldest forgotten)


class PeerLimit(ValueError):
    """Every one of the decode worker's MAX_PREFILL_PEERS peers is busy."""


class PrefillPeers:
    def __init__(
        self,
        cap: int = MAX_PREFILL_PEERS,
        idle_s: float | None = None,
        timing: PdTiming = PD_TIMING,
    ) -> None:
        """`idle_s`: how long an idle peer is kept (None: `timing.peer_idle_s`)."""
        idle_s = timing.peer_idle_s if idle_s is None else idle_s
        if cap < 1 or not idle_s > 0:
            raise ValueError(f"need cap >= 1 and idle_s > 0, got {cap}, {idle_s}")
        self.cap, self.idle_s, self.timing = cap, idle_s, timing
        self._peers: dict[str, PrefillPeer] = {}
        self._used: dict[str, float] = {}  # address -> when a room or Register last used it
        self._proven: dict[str, None] = {}  # addresses that proved the key once, oldest first
        self._failed: dict[str, float] = {}  # unproven address -> when it failed to prove it
        self.evicted = 0
        self.refused = 0
        self.unproven_refused = 0

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
        peer = self._peers.get(address)
        if peer is not None:
            if peer.refused is not None and not peer.proven:  # it would be paired anew
                self._check_unproven(address, now)
            self._used[address] = now
            return peer, []
        self._check_unproven(address, now)
        self._used[address] = now
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
        peer = self._peers[address] = PrefillPeer(address, last_pong=now)
        return peer, forgotten

    def _check_unproven(self, address: str, now: float) -> None:
        """Raise PeerLimit if a new peer at `address` may not be opened now."""
        if address in self._proven:
            return
        failed = self._failed.get(address)
        backoff = self.timing.unproven_backoff_s
        if failed is not None and now - failed < backoff:
            self.unproven_refused += 1
            raise PeerLimit(
                f"{address} did not prove it is a prefill worker of this cluster (no HelloAck "
                f"signed with the cluster key) {now - failed:.1f}s ago; refused for "
                f"{backoff:.0f}s"
            )
        others = sum(not p.proven for a, p in self._peers.items() if a != address)
        if others >= MAX_UNPROVEN:
            self.unproven_refused += 1
            raise PeerLimit(
                f"{MAX_UNPROVEN} prefill addresses are still to prove they hold the cluster "
                f"key (its limit); {address} is refused"
            )

    def proved(self, address: str) -> None:
        """The peer at `address` proved it holds the cluster key (a valid HelloAck)."""
        self._peers[address].proven = True
        self._failed.pop(address, None)
        _remember(self._proven, address, None)

    def failed_proof(self, address: str, now: float) -> None:
        """The peer at `address` did not prove itself (silent, or a HelloAck naming another
        address): refuse it for `unproven_backoff_s` unless it proved itself before."""
        if address not in self._proven:
            _remember(self._failed, address, now)

    def acked(self, address: str, ok: bool, error: str | None) -> tuple[list[int], str | None]:
        """A RegisterAck from `address`: (the rooms that waited for it, None) when it paired
        us, (those rooms, why) when it refused. KeyError for an address we never asked."""
        peer = self._peers[address]
        queued, peer.queued = peer.queued, []
        if not ok:
            peer.refused = error or "registration refused"
            return queued, peer.refused
        peer.registered, peer.refused = True, None
        return queued, None

    def replace(self, address: str) -> PrefillPeer:
        """A fresh record for a known address (after it refused us or was declared dead); when
        it last spoke carries over (its silence counts from the rooms that wait on it)."""
        old = self._peers[address]  # KeyError for an address not known
        peer = self._peers[address] = PrefillPeer(address, last_pong=old.last_pong)
        return peer

    def liveness(
        self, now: float, waiting_since: Mapping[str, float]
    ) -> tuple[list[PrefillPeer], list[tuple[PrefillPeer, float]]]:
        """(peers to ping now, [(peer declared dead, seconds silent)]). `waiting_since`: the
        addresses with rooms waiting on them, each with when its oldest such room opened.
        Silence counts from when we began waiting: the last pong, or the oldest waiting room
        if it is younger (a P silent while we asked nothing is not yet dead). A dead peer is
        marked to pair anew when it comes back."""
        pings: list[PrefillPeer] = []
        dead: list[tuple[PrefillPeer, float]] = []
        for peer in self._peers.values():
            since = waiting_since.get(peer.address)
            if since is None and not peer.registered:
                continue
            if peer.proven and now - peer.last_ping > self.timing.ping_every_s:
                peer.last_ping = now
                pings.append(peer)
            if since is None:
                continue
            waited = now - max(peer.last_pong, since)
            if waited > self.timing.peer_timeout_s:
                peer.registered = False  # re-register when it comes back
                peer.refused = "declared dead"
                peer.queued = []  # those rooms end as PEER_DEAD: the peer is idle now
                dead.append((peer, waited))
                if not peer.proven:
                    self.failed_proof(peer.address, now)
        return pings, dead

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
            "unproven": sum(not p.proven for p in self._peers.values()),
            "unproven_refused": self.unproven_refused,
        }


def _remember(table: dict[str, Any], address: str, value: Any) -> None:
    """Put `address` last in `table`, forgetting the oldest entry past MAX_REMEMBERED."""
    table.pop(address, None)
    table[address] = value
    if len(table) > MAX_REMEMBERED:
        del table[next(iter(table))]
