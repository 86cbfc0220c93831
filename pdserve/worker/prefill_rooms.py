"""What the prefill role keeps per room: one decode worker's request, its pages and writes.

A room's state moves only through the P table of `protocol/rooms.py` (worker/prefill.py
drives it). Its source pages pass from the request to the room when the request leaves the
batch and are released only by FREE_PAGES, once no write reads them (LESSONS #7).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.engine.request import Request, TokenLogprob
from pdserve.kvcache.lease import Lease
from pdserve.protocol.rooms import PState
from pdserve.transfer.dataplane import Pending


@dataclass
class PRoom:
    peer: str
    peer_generation: int  # the registration it came in on; only that one may write for it
    room: int
    epoch: int
    request: Request
    dst_pages: list[int]
    deadline: float
    state: PState = PState.PREFILLING
    pages_written: int = 0
    bytes_written: int = 0
    first_token: int | None = None
    first_logprob: TokenLogprob | None = None
    reason: str = ""
    since: float = field(default_factory=time.monotonic)
    write_deadline: float = 0.0  # unix time; no write into dst_pages after it
    inflight: list[Pending] = field(default_factory=list)  # writes not yet complete
    # The source pages once the request left the batch, kept while writes read them; released
    # only by FREE_PAGES.
    lease: Lease | None = None
    writes_cancelled: bool = False  # a write was released unconfirmed: D must fence

    @property
    def write_deadline_mono(self) -> float:
        return time.monotonic() + (self.write_deadline - time.time())
