"""What the decode role keeps: requests waiting for pages, prefill peers, and rooms.

A room is one request's prefill leg with one prefill worker; its state moves only through the
D table of `protocol/rooms.py` (worker/decode/role.py drives it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request import Request, TokenLogprob
from pdserve.kvcache.lease import Lease
from pdserve.kvcache.pool import KVPool
from pdserve.protocol import messages as m
from pdserve.protocol.outputs import DEADLINE_ERROR
from pdserve.protocol.rooms import DState
from pdserve.worker.decode.clock_skew import SkewWatch


@dataclass(frozen=True)
class HeldSubmit:
    """A request waiting for destination pages before its room opens."""

    request: Request
    prefill: str  # the prefill worker's control address


@dataclass
class PrefillPeer:
    address: str
    last_pong: float  # monotonic: when it last said anything (or when we first opened it)
    # Proven: its HelloAck came back signed with the cluster key, with our nonce and this
    # address. Until then it gets a Hello and nothing else (no Register, no Ping).
    proven: bool = False
    hello_nonce: int | None = None  # the Hello in flight
    registered: bool = False
    refused: str | None = None
    last_ping: float = 0.0
    queued: list[int] = field(default_factory=list)  # rooms waiting for RegisterAck
    clock: SkewWatch = field(init=False)

    def __post_init__(self) -> None:
        self.clock = SkewWatch(self.address)


@dataclass
class DRoom:
    room: int
    epoch: int
    request: Request
    peer: str
    deadline: float
    # The destination pages. Released only by FREE_PAGES; on START_DECODE handed over to the
    # request (LESSONS #7).
    lease: Lease
    since: float  # monotonic: when it entered its state
    state: DState = DState.PENDING
    first_token: int | None = None
    first_logprob: TokenLogprob | None = None
    reason: str = ""
    write_deadline: float = 0.0  # unix time after which P may not write (sent to P)
    bytes_received: int = 0  # tcp, nixl: KV bytes that arrived for this room
    done: m.PrefillDone | None = None  # nixl: PrefillDone that came before all its bytes
    reregistered: bool = False  # P refused it as unregistered once; we paired again
    requested: float | None = None  # monotonic: when its last PrefillRequest left
    opened: float = field(init=False)  # monotonic: when it opened (its first `since`)

    def __post_init__(self) -> None:
        self.opened = self.since

    def state_pages(self, pool: KVPool) -> list[int]:
        """The pages of its state slot (a pool with per-request state), where P writes the
        room's state once; empty otherwise."""
        slot = self.lease.slot
        if pool.state is None or slot is None:
            return []
        first = pool.state.first_page(slot)
        return list(range(first, first + pool.state.pages_each))

    def writable(self, pool: KVPool) -> set[int]:
        """The pages P may write for it: its destination pages and its state slot's."""
        return set(self.lease.pages) | set(self.state_pages(pool))

    def take_done(
        self, counts_bytes: bool, bytes_may_trail: bool, state_bytes: int, vocab_size: int
    ) -> str | None:
        """Check the PrefillDone it holds and take its first token (and prompt logprobs):
        None when the request can decode, WAIT while its bytes still travel apart from it
        (nixl; the room's deadline bounds the wait), else why the room fails (never decode on
        KV we did not receive). `state_bytes`: the bytes of its state slot (0 without one),
        which P must have written whole."""
        msg, req = self.done, self.request
        assert msg is not None  # only called after PrefillDone was recorded
        if not 0 <= msg.first_token < vocab_size:
            return f"the prefill worker's first token {msg.first_token} is not in the vocabulary"
        waits_for_kv = self.state in (DState.PENDING, DState.PREFILLING)
        if waits_for_kv and counts_bytes and self.bytes_received != msg.kv_bytes:
            if bytes_may_trail and self.bytes_received < msg.kv_bytes:
                return WAIT
            return f"incomplete KV: received {self.bytes_received} of {msg.kv_bytes} bytes"
        if waits_for_kv and msg.state_bytes != state_bytes:
            return (
                f"incomplete KV: the prefill worker wrote {msg.state_bytes} bytes of "
                f"per-request state, {state_bytes} expected"
            )
        if req.params.prompt_logprobs is not None:
            if len(msg.prompt_logprobs) != len(req.prompt_ids) - 1:
                return (
                    f"the prefill worker sent {len(msg.prompt_logprobs)} prompt logprobs for "
                    f"{len(req.prompt_ids)} prompt tokens"
                )
            req.prompt_logprobs = list(msg.prompt_logprobs)
        self.first_token = msg.first_token
        self.first_logprob = msg.first_logprob
        return None


WAIT = "wait"  # DRoom.take_done: the KV bytes are still on their way


def blame(room: DRoom, why: str, now: float) -> str:
    """Why a room that P refused or failed ended, saying whose fault it was. P refuses a write
    deadline already past and fails a room whose writes outlive it, and a room's write
    deadline is the client's own timeout when that is the nearer one (`_open_room`): an end
    that finds the request past its own deadline is that deadline's doing (the client's 408,
    by the same rule as `expire`); any other is P's (a 500). `now`: monotonic."""
    deadline = room.request.deadline
    if deadline is not None and now >= deadline:
        return f"{DEADLINE_ERROR} in state {room.state.value} ({why})"
    return why
