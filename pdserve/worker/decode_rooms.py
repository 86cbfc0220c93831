"""What the decode role keeps: requests waiting for pages, prefill peers, and rooms.

A room is one request's prefill leg with one prefill worker; its state moves only through the
D table of `protocol/rooms.py` (worker/decode.py drives it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.engine.request import Request, TokenLogprob
from pdserve.kvcache.lease import Lease
from pdserve.protocol import messages as m
from pdserve.protocol.rooms import DState
from pdserve.worker.clock_skew import SkewWatch


@dataclass(frozen=True)
class Admission:
    """A request waiting for destination pages before its room opens."""

    request: Request
    prefill: str  # the prefill worker's control address


@dataclass
class PrefillPeer:
    address: str
    registered: bool = False
    refused: str | None = None
    last_pong: float = field(default_factory=time.monotonic)
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
    state: DState = DState.PENDING
    since: float = field(default_factory=time.monotonic)
    first_token: int | None = None
    first_logprob: TokenLogprob | None = None
    reason: str = ""
    write_deadline: float = 0.0  # unix time after which P may not write (sent to P)
    bytes_received: int = 0  # tcp, nixl: KV bytes that arrived for this room
    done: m.PrefillDone | None = None  # nixl: PrefillDone that came before all its bytes
    reregistered: bool = False  # P refused it as unregistered once; we paired again
