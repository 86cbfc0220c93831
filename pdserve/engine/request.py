"""A request inside the engine, and its lifecycle as one transition table.

Only the engine thread touches a Request. `status` changes only through `transition()`,
which refuses an edge the table does not list; finished states are sticky.
"""

from __future__ import annotations

import enum
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.kvcache.lease import Lease, LeaseError
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.outputs import TokenLogprob as TokenLogprob  # re-exported
from pdserve.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds pages; prefilling in chunks or decoding
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token
    FINISHED_LENGTH = "finished_length"  # max_tokens or the context limit
    FINISHED_ABORTED = "finished_aborted"  # the client went away or asked to stop
    FINISHED_FAILED = "finished_failed"  # an error; the reason travels with it

    @property
    def finished(self) -> bool:
        # By identity: a set lookup hashes an enum member in Python, and this runs for every
        # token. Every state but these two is in FINISHED (tests/engine/test_request.py).
        return self is not Status.WAITING and self is not Status.RUNNING


FINISHED = frozenset(
    {
        Status.FINISHED_STOPPED,
        Status.FINISHED_LENGTH,
        Status.FINISHED_ABORTED,
        Status.FINISHED_FAILED,
    }
)


class Event(enum.Enum):
    SCHEDULE = "schedule"
    PREEMPT = "preempt"
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    FAIL = "fail"


TRANSITIONS: dict[tuple[Status, Event], Status] = {
    (Status.WAITING, Event.SCHEDULE): Status.RUNNING,
    # A request preempted while a step that samples for it is in flight (overlapped
    # scheduling) is WAITING when that token arrives; a token that ends it (a stop, its last
    # by max_tokens or the context) ends it there, as it would have running.
    (Status.WAITING, Event.STOP): Status.FINISHED_STOPPED,
    (Status.WAITING, Event.LENGTH): Status.FINISHED_LENGTH,
    (Status.WAITING, Event.ABORT): Status.FINISHED_ABORTED,
    (Status.WAITING, Event.FAIL): Status.FINISHED_FAILED,
    (Status.RUNNING, Event.PREEMPT): Status.WAITING,
    (Status.RUNNING, Event.STOP): Status.FINISHED_STOPPED,
    (Status.RUNNING, Event.LENGTH): Status.FINISHED_LENGTH,
    (Status.RUNNING, Event.ABORT): Status.FINISHED_ABORTED,
    (Status.RUNNING, Event.FAIL): Status.FINISHED_FAILED,
}


class IllegalTransition(RuntimeError):
    pass


FINISH_REASON = {
    Status.FINISHED_STOPPED: "stop",
    Status.FINISHED_LENGTH: "length",
    Status.FINISHED_ABORTED: "abort",
    Status.FINISHED_FAILED: "error",
}


OutputSink = Callable[[RequestOutput], None]


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: OutputSink
    eos_token_ids: frozenset[int] = frozenset()
    deadline: float | None = None  # monotonic; past it the engine fails the request
    arrival: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    # Its pages, while it holds any: only the scheduler opens, grows and ends this lease.
    lease: Lease | None = None
    unleased_pages: list[int] = field(default_factory=list, repr=False)  # see `pages`
    num_computed: int = 0  # tokens whose K/V is in the pool
    # Per-request state (DeepSeek-V4): admitted on a cached prefix, its state slot is rebuilt
    # from the prefix's last page on its next step (attention/step_kv.py Span.resumes).
    resumes_state: bool = False
    # Overlapped scheduling (engine/inflight.py): tokens sampled by a step still in flight,
    # counted in `num_tokens` but not yet in `output_ids` (0 or 1 when the scheduler runs; 2
    # while a step is launched before the one in flight is processed), and whether the newest
    # pending token is surely the last (max_tokens, the length limit): nothing more runs.
    pending: int = 0
    pending_last: bool = False
    num_preemptions: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    state_since: float = field(default_factory=time.monotonic)
    error: str | None = None
    # params.prompt_logprobs' scores, of prompt tokens 1, 2, ... in order: the runner appends
    # them chunk by chunk (a recomputed chunk adds nothing twice); the first output carries them.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list, repr=False)
    prompt_logprobs_sent: bool = False
    # Its random stream's seed: the params' seed, or one drawn here for a request that came
    # without (the OpenAI front end always sets one, so PD and co-located draw alike). The
    # draw at output position i is a function of (seed, i): engine/sampling/random_stream.py.
    seed: int = field(init=False)
    # Its params ask for the plain argmax and nothing else (no bias, bans, penalties, draw or
    # logprobs): a step whose rows all do needs no sampling tensors (sampling/batch.py).
    argmax_only: bool = field(init=False)
    # Structured output (params.constraint): its grammar's matcher, made on first use and
    # advanced by every token emitted (engine/sampling/grammars.py); None without one.
    constrained: bool = field(init=False)
    matcher: LLMatcher | None = field(default=None, repr=False)
    # Its grammar is still compiling: the scheduler passes it over (engine/grammar_waits.py).
    grammar_wait: bool = False

    def __post_init__(self) -> None:
        p = self.params
        self.seed = p.seed if p.seed is not None else secrets.randbits(64)
        self.argmax_only = (
            p.greedy
            and not p.logit_bias
            and not p.min_tokens
            and not p.needs_penalties
            and p.logprobs is None
        )
        self.constrained = p.constraint is not None

    @property
    def pages(self) -> list[int]:
        """Its page table in token order, a copy: the runner builds attention metadata from it."""
        return list(self.lease.pages) if self.lease is not None else list(self.unleased_pages)

    @pages.setter
    def pages(self, pages: list[int]) -> None:
        """A page table built by hand, outside any pool's accounting (tests and tools only);
        leased pages change only through the lease."""
        if self.lease is not None:
            raise LeaseError(f"request {self.request_id}: its pages belong to {self.lease!r}")
        self.unleased_pages = list(pages)

    @property
    def page_view(self) -> Sequence[int]:
        """Its page table without a copy (read it, never keep it): the runner's per-step read."""
        return self.lease.pages if self.lease is not None else self.unleased_pages

    def tokens(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (a decode reads one token a step)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def token_at(self, pos: int) -> int | None:
        """all_ids[pos], or None for a token still in flight (`pending`): a decode's input."""
        n = len(self.prompt_ids)
        if pos < n:
            return self.prompt_ids[pos]
        return self.output_ids[pos - n] if pos - n < len(self.output_ids) else None

    @property
    def num_pages(self) -> int:
        return len(self.lease) if self.lease is not None else len(self.unleased_pages)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Its tokens as the scheduler counts them: prompt, outputs and a pending token."""
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far, a pending one included: the next token's output position."""
        return len(self.output_ids) + self.pending

    def launch_token(self, max_len: int) -> None:
        """A step that samples its next token was launched: that token is pending until the
        step completes, and `pending_last` says whether it is surely the last (max_tokens, or
        `max_len` tokens in all): nothing more is scheduled for it (engine/inflight.py)."""
        self.pending += 1
        out = len(self.output_ids) + self.pending  # num_output_tokens, in one frame: per row
        self.pending_last = out >= self.params.max_tokens or len(self.prompt_ids) + out >= max_len

    @property
    def num_uncomputed(self) -> int:
        if self.pending_last:
            return 0  # its last token is in flight: nothing more to compute
        return self.num_tokens - self.num_computed

    def take_prompt_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The prompt's scores, once: for the request's first output (empty if not asked)."""
        if self.prompt_logprobs_sent or self.params.prompt_logprobs is None:
            return ()
        self.prompt_logprobs_sent = True
        return tuple(self.prompt_logprobs)

    def transition(self, event: Event) -> Status:
        nxt = TRANSITIONS.get((self.status, event))
        if nxt is None:
            raise IllegalTransition(
                f"request {self.request_id}: {event.name} in {self.status.name}"
            )
        self.status = nxt
        self.state_since = time.monotonic()
        return nxt
