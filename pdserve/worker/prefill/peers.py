"""A prefill worker's decode peers: pairing on Register, one writer each, dropping them.

A peer is paired when its Register message checks out (same KV layout; the data plane it
names can be opened: its shm pool, its control socket, its NIXL agent). `generation` numbers
each pairing: the same decode worker may register again (after it declared this P dead), and
a write that fails for an earlier pairing must not drop the current one. A dropped peer's
writer is closed `close_after_s` (runtime/timing.py) later, after the engine's ticks (`tick`)
let UCX fail what it still had queued for that peer: tearing a UCX endpoint down with requests
queued can abort the process. Owned by the prefill engine thread, like everything it touches;
it reads no clock: its caller passes `now`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPool
from pdserve.kvcache.rank_pages import RankPages
from pdserve.protocol import messages as m
from pdserve.runtime.timing import PdTiming
from pdserve.transfer.control import Control
from pdserve.transfer.copier import Copier
from pdserve.transfer.dataplane import PeerWriter
from pdserve.transfer.nixl import NixlAgent
from pdserve.transfer.writers import open_writer


@dataclass
class DecodePeer:
    identity: str
    writer: PeerWriter
    num_pages: int  # its pool's KV pages (Register.num_pages): its state slots' pages follow
    generation: int  # which pairing: the same D may register again
    last_seen: float  # monotonic: when it last sent anything
    state_slots: int = 0  # per-request state slots after its pages (Register.state_slots)
    # The pages a PrefillRequest's dst_pages may name: num_pages, or every rank's with `dp`.
    dst_limit: int = 0
    first_tokens: bool = False  # it takes FirstToken (Register.first_tokens)


class DecodePeers:
    def __init__(
        self,
        pool: KVPool,
        pages: RankPages,
        identity: str,
        control: Control | None,
        copier: Copier | None,
        timing: PdTiming,
    ) -> None:
        """`pool`: rank 0's (NIXL registers it); `pages`: every rank's, as the whole model's
        (what D's layout is compared with); `identity`: this prefill worker's;
        `control`: the tcp backend sends pages on it (None: no tcp peer can pair)."""
        self.pool = pool
        self.pages = pages
        # our follower ranks' processes (their pools are shared): a peer naming one is refused
        self.own_pids = frozenset(r.pid for r in pages.refs[1:] if r is not None)
        self.timing = timing
        self.identity = identity
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

    def register(self, identity: str, msg: m.Register, now: float) -> DecodePeer:
        """Pair with a decode worker; raises (ValueError, OSError, NIXL's errors) saying why not."""
        ours = self.pages.layout
        theirs = KVLayout.from_desc(msg.layout)
        diff = ours.mismatch(theirs, ours="prefill", theirs="decode")
        if diff is not None:
            raise ValueError(f"KV layout mismatch, {diff} (prefill vs decode)")
        old = self.by_id.pop(identity, None)
        if old is not None:  # the same D again: it replaces its pairing. NIXL holds one remote
            old.writer.close()  # agent per name, so the old one goes before the new one loads
        writer = open_writer(
            msg,
            identity,
            theirs,
            identity=self.identity,
            control=self.control,
            copier=self.copier,
            nixl_agent=self._nixl_agent,
            tp=self.pages.tp,
            own_pids=self.own_pids,
        )
        self.pairings += 1
        peer = DecodePeer(
            identity, writer, msg.num_pages, self.pairings, now, msg.state_slots,
            dst_limit=msg.num_pages * (msg.tp if msg.dp else 1), first_tokens=msg.first_tokens,
        )  # fmt: skip
        self.by_id[identity] = peer
        return peer

    def _nixl_agent(self) -> NixlAgent:
        if self.nixl is None:
            self.nixl = NixlAgent(self.identity, self.pool)
        return self.nixl

    def drop(self, peer: DecodePeer, now: float) -> None:
        """Forget the peer now; its writer is closed `close_after_s` later (see the header)."""
        del self.by_id[peer.identity]
        self.closing.append((now + self.timing.close_after_s, peer.writer))

    def silent(self, now: float) -> list[DecodePeer]:
        """The peers silent for longer than `peer_silence_s` (D pings every second)."""
        return [p for p in self.by_id.values() if now - p.last_seen > self.timing.peer_silence_s]

    def tick(self, now: float) -> None:
        """Every engine tick: drive UCX (no progress thread of its own), retry handle
        releases NIXL refused, close the writers of peers dropped long enough ago."""
        if self.nixl is not None:
            self.nixl.progress()
            self.nixl.retry_releases()
        while self.closing and self.closing[0][0] <= now:
            self.closing.popleft()[1].close()
