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
(a command raised), `on_control` (on the control thread, before a message is queued),
`has_work`, `rooms`, `snapshot`, and at shutdown `settle` and `hard_exit`.

Time is an input: every verb that may change a room or judge a deadline takes `now`, the
engine clock's monotonic reading (`Engine.clock`, runtime/timing.py `Clock`); a role reads no
clock of its own but that clock's `wall()`, for what crosses hosts. A role changes requests
only through the engine's verbs (`Engine.finish`, `Engine.emit_token`, the scheduler's
`add`/`adopt`) and pages only through leases. `Colocated` is the role of a worker that
prefills and decodes itself: every verb does nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from pdserve.protocol.messages import Send

if TYPE_CHECKING:
    from pdserve.engine.request import Request, TokenLogprob
    from pdserve.engine.scheduler import StepPlan


class Room(Protocol):
    """What the engine reads of a role's room: /health's overdue list names it."""

    room: int
    state: Any  # an enum with .value
    deadline: float  # monotonic


class Role(Protocol):
    name: str
    # Whether the engine may process a step's tokens one step later (engine/inflight.py): a
    # role that ships each step's KV and first token at once (prefill) says no.
    overlaps: bool

    def handle(self, cmd: object, now: float) -> None:
        """A command the engine does not know; raises TypeError for one this role does not take."""
        ...

    def abort(self, request_id: str, now: float) -> bool:
        """End a request the role holds outside the scheduler; True if it held it."""
        ...

    def fail(self, req: Request, why: str, now: float) -> bool:
        """A step failed `req`; True if the role ends it its own way (a prefill room fails)."""
        ...

    def command_failed(self, cmd: object, why: str, now: float) -> None:
        """`cmd` raised while handled: end only the request or room it concerned."""
        ...

    def poll_transfers(self, now: float) -> None: ...

    def expire(self, now: float) -> None: ...

    def admit(self, now: float) -> None: ...

    def after_forward(self, plan: StepPlan, now: float) -> None: ...

    def take_token(self, req: Request, tok: int, lp: TokenLogprob | None, now: float) -> bool: ...

    # Whether take_token may ever return True (a prefill role's first tokens); False: the
    # engine streams every token without asking, a call saved per token.
    takes_tokens: bool

    def take_outbox(self) -> list[Send]: ...

    def on_control(self, inbound: Any, now: float) -> Send | None:
        """On the control thread, before `inbound` is queued: an immediate answer, if any.
        `now`: the engine clock's reading on that thread."""
        ...

    def has_work(self) -> bool:
        """Transfers to poll or rooms to time: the loop waits briefly instead of idling."""
        ...

    def rooms(self) -> list[Room]: ...

    def snapshot(self, now: float) -> dict[str, Any]: ...

    def settle(self) -> None:
        """At shutdown, once the engine thread stopped: let transfers still queued fail."""
        ...

    @property
    def hard_exit(self) -> bool:
        """Whether the process must leave without the interpreter's teardown (UCX can abort
        the process tearing down an endpoint with requests queued for a stopped peer)."""
        ...


class Colocated:
    """The role of a worker that prefills its requests itself: nothing to add to the loop."""

    name = "colocated"
    overlaps = True
    takes_tokens = False

    def handle(self, cmd: object, now: float) -> None:
        raise TypeError(f"a co-located engine takes no {type(cmd).__name__}")

    def abort(self, request_id: str, now: float) -> bool:
        return False

    def fail(self, req: Request, why: str, now: float) -> bool:
        return False

    def command_failed(self, cmd: object, why: str, now: float) -> None:
        pass

    def poll_transfers(self, now: float) -> None:
        pass

    def expire(self, now: float) -> None:
        pass

    def admit(self, now: float) -> None:
        pass

    def after_forward(self, plan: StepPlan, now: float) -> None:
        pass

    def take_token(self, req: Request, tok: int, lp: TokenLogprob | None, now: float) -> bool:
        return False

    def take_outbox(self) -> list[Send]:
        return []

    def on_control(self, inbound: Any, now: float) -> Send | None:
        return None

    def has_work(self) -> bool:
        return False

    def rooms(self) -> list[Room]:
        return []

    def snapshot(self, now: float) -> dict[str, Any]:
        return {}

    def settle(self) -> None:
        pass

    @property
    def hard_exit(self) -> bool:
        return False
