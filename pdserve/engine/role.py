"""What a worker's role adds to the engine loop, as verbs the loop calls by name.

The engine (engine/engine.py) is composed of a scheduler, a runner, the sampler and one role.
Each tick calls, in order (docs/architecture.md §Loop):

    handle(cmd, now)               an inbox command that is not the engine's own (a peer's
                                   message, a failed send, a submission with a prefill address)
    poll_transfers(now)            collect completed KV writes or landed bytes
    expire(now)                    the role's time-driven work: room deadlines, pings, silent
                                   peers
    admit(now)                     start what now fits (the decode role opens rooms)
    after_forward(plan, now)       a step's chunks have their KV in the pool (the prefill role
                                   ships it)
    take_token(req, tok, lp, now)  a sampled token; True if the role consumed it (else it is
                                   streamed); asked only of a role whose `takes_tokens` is True
    take_outbox()                  the messages to send, drained: roles never call the control
                                   plane

and, off the loop: `abort` (the AbortCommand), `fail` (a step failed a request), `command_failed`
(a command raised), `local_prefill` (a submission the engine prefills itself: the decode role
counts it, as no prefill worker was named), `kept` (the pages a `KeepPages` kept), `pins` (the
scheduler: may this request be preempted), `on_control` (on the control thread, before a
message is queued: it may answer, never ask for an effect), `while_waiting` (mid-step, while
the engine thread waits for a step's tokens, if `works_while_waiting`: the prefill role answers
finished writes there rather than a step later), `has_work`, `rooms`, `snapshot`, and at
shutdown `settle` and `hard_exit`.

Time is an input: every verb that may change a room or judge a deadline takes `now`, the
engine clock's monotonic reading (`Engine.clock`, runtime/timing.py `Clock`); a role reads no
clock of its own but that clock's `wall()`, for what crosses hosts.

A role sees its engine only as a `RoleHost`, and only reads it: the clock, the pool, the EOS
ids, the vocabulary's size, the tick's start, the request timeout, and three questions that
must be answered at once, `validate` (may this request be served: a PrefillRequest is refused on
the spot), `streams_early` (may a peer's first token stream before its KV) and `open_lease`
(pages now, or PageAllocError: a room is opened only with its pages).
Whatever changes the engine's requests, the role asks for and the engine does, as the rooms'
tables return commands: it appends an *effect* (below) to `effects`, and the engine applies them in
order (`Engine.apply_effects`, engine/role_host.py) as soon as the verb that asked returns, or
raises, before anything else happens; a failing effect costs its request alone (`fail`, else
FAIL). Likewise it sends messages only by returning them (`take_outbox`). It never touches the
scheduler, the leases of requests or the engine's metrics. The tokens the engine counts
itself: a submission's prompt (the decode role's too), a prompt it computes, a token a role
takes. Two effects answer: `KeepPages` ends a request but hands its lease to the role through a
verb (`kept`), whose room then releases it; an `Adopt` calls its `started(now)` once the
scheduler took the request (the decode role counts a completed transfer there). A
`StreamFirst` streams a peer's first token ahead of its Adopt where it cannot end the
request. The scheduler asks `pins(req)` before preempting. `Role` is the base every role
derives from: each verb's default is "nothing to add", so a role writes only the verbs it has.
`Colocated`, the role of a worker that prefills and decodes itself, is the base alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pdserve.protocol.messages import Send

if TYPE_CHECKING:
    from pdserve.engine.request import Event, Request, TokenLogprob
    from pdserve.engine.scheduler import StepPlan
    from pdserve.kvcache.lease import Lease
    from pdserve.kvcache.pool import KVPool
    from pdserve.kvcache.rank_pages import RankPages
    from pdserve.protocol.sampling import SamplingParams
    from pdserve.runtime.timing import Clock


class RoleHost(Protocol):
    """The engine as a role sees it (engine/engine.py implements it): only what a role may
    read, and the two questions it needs answered at once. Changes are effects (below)."""

    clock: Clock
    pool: KVPool
    # The pages a PD role moves, every rank's as the whole model's (kvcache/rank_pages.py);
    # None only for a co-located engine at TP > 1.
    pages: RankPages | None
    eos_token_ids: frozenset[int]
    vocab_size: int  # a token id a peer sends is checked against it
    last_tick: float  # monotonic: when the engine's current tick began

    @property
    def request_timeout_s(self) -> float: ...

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """InvalidParams for a request this engine can never serve."""

    def streams_early(self, req: Request, tok: int) -> bool:
        """May `req`'s first token `tok`, sampled by a peer, stream before its KV is here
        (engine/request_end.py)."""

    def open_lease(self, owner: str, num_pages: int) -> Lease:
        """A lease on `num_pages` free pages for `owner`, with a state slot where the pool keeps
        per-request state; PageAllocError (SlotError) when too few are free."""


# -- effects: what a role asks the engine to do (Engine.apply_effects) --------------------------
@dataclass(frozen=True)
class ComputePrompt:
    """Schedule `req` to compute its prompt here (a prefill room's request)."""

    req: Request
    why_failed: ClassVar[str] = "its prompt could not be scheduled"


@dataclass(frozen=True)
class Adopt:
    """Decode `req`, whose prompt KV a peer wrote into `lease`'s pages (handed to the request)
    and whose first token `token` it sampled; the token is streamed as if sampled here. If it
    cannot start, the lease is released and the request fails. `started(now)`, if given, is
    called once the scheduler took it (the role counts a completed transfer there, not
    before)."""

    req: Request
    lease: Lease
    token: int
    logprob: TokenLogprob | None
    started: Callable[[float], None] | None = None
    why_failed: ClassVar[str] = "its decode could not start"


@dataclass(frozen=True)
class StreamFirst:
    """Stream `req`'s first token `token`, sampled by a peer, before its KV is here, unless the
    token would end the request or the request needs what only comes with the KV (its prompt's
    logprobs, a grammar's matcher): its Adopt then takes the token without streaming it again,
    and a request that did not stream it early streams it at its Adopt, as before."""

    req: Request
    token: int
    logprob: TokenLogprob | None
    why_failed: ClassVar[str] = "its first token could not be streamed"


@dataclass(frozen=True)
class Finish:
    """End `req` (Engine.finish): a request outside the scheduler (its room owns its pages),
    or one the scheduler releases."""

    req: Request
    event: Event
    error: str | None = None
    why_failed: ClassVar[str] = "it could not be ended"


@dataclass(frozen=True)
class KeepPages:
    """End `req` but keep its pages for `owner`: the lease (None if it held no pages) goes
    back to the role through `kept`, before any other effect is applied."""

    req: Request
    event: Event
    owner: str
    why_failed: ClassVar[str] = "it could not leave the batch"


Effect = ComputePrompt | Adopt | StreamFirst | Finish | KeepPages


class Room(Protocol):
    """What the engine reads of a role's room: /health's overdue list names it."""

    room: int
    state: Any  # an enum with .value
    deadline: float  # monotonic


class Role:
    """A role's verbs, each defaulting to nothing to add (the co-located worker's answer)."""

    name = "colocated"
    # Whether the engine may process a step's tokens one step later (engine/inflight.py): a
    # role that ships each step's KV and first token at once (prefill) says no.
    overlaps = True
    # Whether take_token may ever return True (a prefill role's first tokens); False: the
    # engine streams every token without asking, a call saved per token.
    takes_tokens = False
    # Whether `while_waiting` does anything; False: the engine does not call it.
    works_while_waiting = False

    def __init__(self) -> None:
        self.effects: list[Effect] = []  # asked for, not yet applied: the engine drains it

    def take_effects(self) -> list[Effect]:
        out, self.effects = self.effects, []
        return out

    def handle(self, cmd: object, now: float) -> None:
        """A command the engine does not know; raises TypeError for one this role does not take."""
        raise TypeError(f"a {self.name} engine takes no {type(cmd).__name__}")

    def abort(self, request_id: str, now: float) -> bool:
        """End a request the role holds outside the scheduler; True if it held it."""
        return False

    def local_prefill(self, req: Request, now: float) -> None:
        """`req` came with no prefill address and the engine computes its prompt itself (on a
        decode worker: served decode-only). Only to observe: the engine owns the request."""

    def fail(self, req: Request, why: str, now: float) -> bool:
        """A step failed `req`; True if the role ends it its own way (a prefill room fails)."""
        return False

    def command_failed(self, cmd: object, why: str, now: float) -> None:
        """`cmd` raised while handled: end only the request or room it concerned."""

    def kept(self, req: Request, lease: Lease | None, now: float) -> None:
        """The engine ended `req` as a `KeepPages` asked: its pages are the role's from now on
        (None: it held none). A role that keeps no pages frees them."""
        if lease is not None:
            lease.release()

    def pins(self, req: Request) -> bool:
        """Whether the scheduler must not preempt `req` (a transfer still reads its pages)."""
        return False

    def poll_transfers(self, now: float) -> None:
        pass

    def expire(self, now: float) -> None:
        pass

    def while_waiting(self, now: float, in_step: Callable[[Request], bool]) -> None:
        """Called by the engine thread, every half millisecond or so, while it waits for a
        step on the device (runtime/gpu_wait.py): work that would otherwise wait for the
        step's end, such as answering finished transfers. Mid-step, so it must leave alone
        the scheduler, every request of the batch and every request the step computes
        (`in_step(req)`: the device may still write its pages), and must not block. What it
        sends goes out at once; effects it asks are applied after the step."""

    def admit(self, now: float) -> None:
        pass

    def after_forward(self, plan: StepPlan, now: float) -> None:
        pass

    def take_token(self, req: Request, tok: int, lp: TokenLogprob | None, now: float) -> bool:
        return False

    def take_outbox(self) -> list[Send]:
        return []

    def on_control(self, inbound: Any, now: float) -> Send | None:
        """On the control thread, before `inbound` is queued: an immediate answer, if any."""
        return None

    def has_work(self) -> bool:
        """Transfers to poll or rooms to time: the loop waits briefly instead of idling."""
        return False

    def rooms(self) -> list[Room]:
        return []

    def snapshot(self, now: float) -> dict[str, Any]:
        return {}

    def settle(self) -> None:
        """At shutdown, once the engine thread stopped: let transfers still queued fail."""

    @property
    def hard_exit(self) -> bool:
        """Whether the process must leave without the interpreter's teardown (UCX can abort
        the process tearing down an endpoint with requests queued for a stopped peer)."""
        return False


class Colocated(Role):
    """The role of a worker that prefills its requests itself: nothing to add to the loop."""
