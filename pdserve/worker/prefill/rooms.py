"""What the prefill role keeps per room: one decode worker's request, its pages and writes.

A room's state moves only through the P table of `protocol/rooms.py` (worker/prefill/role.py
drives it). Its source pages pass from the request to the room when the request leaves the
batch and are released only by FREE_PAGES, once no write reads them (LESSONS #7).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.request import Request, TokenLogprob
from pdserve.kvcache.lease import Lease
from pdserve.protocol import messages as m
from pdserve.protocol.rooms import PState
from pdserve.protocol.sampling import InvalidParams, SamplingParams
from pdserve.transfer.dataplane import Pending


@dataclass
class PRoom:
    peer: str
    peer_generation: int  # the registration it came in on; only that one may write for it
    room: int
    epoch: int
    request: Request
    dst_pages: list[int]
    deadline: float  # monotonic
    since: float  # monotonic: when it entered its state
    state: PState = PState.PREFILLING
    pages_written: int = 0
    bytes_written: int = 0
    first_token: int | None = None
    sends_first_token: bool = False  # its D takes FirstToken (DecodePeer.first_tokens)
    first_logprob: TokenLogprob | None = None
    reason: str = ""
    write_deadline: float = 0.0  # unix time; no write into dst_pages after it
    inflight: list[Pending] = field(default_factory=list)  # writes not yet complete
    # Whether its request is in the batch: until the role asked it out (KeepPages).
    in_batch: bool = True
    # The source pages once the request left the batch (`PrefillRole.kept`), kept while writes
    # read them; released only by FREE_PAGES.
    lease: Lease | None = None
    writes_cancelled: bool = False  # a write was released unconfirmed: D must fence
    # D's pages of the room's state slot (a layout with per-request state), written once after
    # the prompt's last chunk; what was written there.
    state_pages: list[int] = field(default_factory=list)
    state_bytes: int = 0

    def write_deadline_mono(self, now: float, wall: float) -> float:
        """The write deadline on the monotonic clock, given one reading of each clock."""
        return now + (self.write_deadline - wall)

    def first_token_message(self) -> m.FirstToken:
        """What lets D stream the first token before the KV lands."""
        assert self.first_token is not None  # COMPUTED set it
        return m.FirstToken(
            room=self.room, epoch=self.epoch, token=self.first_token, logprob=self.first_logprob
        )

    def done_message(self) -> m.PrefillDone:
        """What tells D its KV is complete: the first token (and its logprob), the bytes
        written, and the prompt's logprobs when asked."""
        assert self.first_token is not None  # COMPUTED set it; not input-dependent
        return m.PrefillDone(
            room=self.room,
            epoch=self.epoch,
            first_token=self.first_token,
            kv_bytes=self.bytes_written,
            state_bytes=self.state_bytes,
            first_logprob=self.first_logprob,
            prompt_logprobs=tuple(self.request.prompt_logprobs),
        )


def check_prefill_request(
    msg: m.PrefillRequest,
    num_pages: int,
    pages_needed: int,
    validate: Callable[[list[int], SamplingParams], None],
    wall: float,
    state: tuple[range, int] | None = None,
) -> tuple[SamplingParams, float] | str:
    """(the params P samples with, seconds left to its write deadline), or why P refuses it:
    destination pages out of D's pool (`num_pages`) or too few, state pages that are not one
    slot's (`state`: D's state pages and a slot's page count, for a layout with per-request
    state; else there must be none), invalid params (`validate`: the engine's rules), a write
    deadline not finite or already past at `wall` (unix time, P's clock)."""
    if len(msg.dst_pages) < pages_needed or any(not 0 <= p < num_pages for p in msg.dst_pages):
        return f"dst_pages invalid: {pages_needed} pages in [0, {num_pages}) needed"
    if state is None and msg.state_pages:
        return "state_pages given, but the KV layout keeps no per-request state"
    if state is not None:
        pages, each = state
        if len(msg.state_pages) != each or any(p not in pages for p in msg.state_pages):
            return f"state_pages invalid: {each} pages in [{pages.start}, {pages.stop}) needed"
    try:
        # P samples output position 0 only, by the same rule as D samples the rest: a
        # min_tokens of 1 or more bans EOS and the stop ids from this token too.
        asked = msg.params  # its fields were checked as the frame was decoded
        params = asked.replace(max_tokens=1, min_tokens=min(asked.min_tokens, 1))
        validate(list(msg.prompt_ids), params)
    except InvalidParams as e:  # replace and validate raise nothing else
        return f"bad request: {e}"
    left = msg.write_deadline - wall
    if not math.isfinite(left):  # NaN would keep the room open for ever
        return f"write_deadline must be a finite unix time, got {msg.write_deadline}"
    if left <= 0:
        return f"arrived {-left:.1f}s after its write deadline"
    return params, left
