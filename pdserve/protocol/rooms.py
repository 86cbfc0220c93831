"""The room state machines of both sides, as transition tables (sans-I/O).

A *room* is one request's prefill leg between a decode worker (D, which owns the request and
the destination pages) and a prefill worker (P, which computes the prompt's KV and writes it
into those pages). Each table maps (state, event) -> (next state, commands). Any pair not in
a table is an explicit outcome too: the event is stale for that state and is dropped and
counted (`Outcome.stale`). Terminal states are sticky. Every non-terminal state has a
deadline event, so no room can wait forever (LESSONS #4, #8, #9).

Page lease rule (LESSONS #7): D frees a room's pages only on a transition that carries
FREE_PAGES, which happens after P said it no longer writes (AbortAck, PrefillDone,
PrefillFailed, PrefillReject) or after a fence once P stopped answering.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Cmd(enum.Enum):
    SEND_ABORT = "send_abort"  # D -> P: Abort{room, epoch}
    FREE_PAGES = "free_pages"  # release the room's pages (D: destination, P: source)
    START_DECODE = "start_decode"  # D: the KV is in place; decode from the first token
    FAIL_REQUEST = "fail_request"  # D: end the client's request with an error
    STOP_COMPUTE = "stop_compute"  # P: drop the room from the prefill batch
    CANCEL_WRITES = "cancel_writes"  # P: release in-flight write handles (deadline hit)
    SEND_DONE = "send_done"  # P -> D: PrefillDone (writes are complete)
    SEND_FIRST_TOKEN = "send_first_token"  # P -> D: FirstToken, if writes are still in flight
    SEND_FAILED = "send_failed"  # P -> D: PrefillFailed (no write in flight)
    SEND_ABORT_ACK = "send_abort_ack"  # P -> D: AbortAck (no write in flight)


class DState(enum.Enum):
    PENDING = "pending"  # pages held, PrefillRequest sent, no answer yet
    PREFILLING = "prefilling"  # P accepted and is computing / writing
    ABORTING = "aborting"  # Abort sent; pages held until P confirms it stopped writing
    FENCED = "fenced"  # P stopped answering; pages quarantined until the fence expires
    DONE = "done"  # KV complete; the request decodes (terminal for the room)
    RELEASED = "released"  # aborted and pages freed (terminal)
    FAILED = "failed"  # failed and pages freed (terminal)


class DEvent(enum.Enum):
    ACCEPT = "accept"
    REJECT = "reject"
    DONE = "done"
    FAILED = "failed"  # P reports failure (it has stopped writing)
    LOCAL_ABORT = "local_abort"  # the client or router aborted
    ABORT_ACK = "abort_ack"
    DEADLINE = "deadline"
    PEER_DEAD = "peer_dead"
    FENCE_EXPIRED = "fence_expired"
    # P stopped, but released writes it could not confirm: bytes may still land.
    WRITES_CANCELLED = "writes_cancelled"
    # Handling one of the room's messages raised here (a bug or input that slipped through):
    # the room ends like a deadline (abort P, fail the request), never the engine thread.
    LOCAL_FAIL = "local_fail"


class PState(enum.Enum):
    PREFILLING = "prefilling"  # computing chunks, writing finished pages
    WRITING = "writing"  # computed; waiting for the last writes to complete
    ABORTING = "aborting"  # abort received; waiting for in-flight writes
    FAILING = "failing"  # failed; waiting for in-flight writes before telling D
    DONE = "done"  # PrefillDone sent (terminal)
    ABORTED = "aborted"  # AbortAck sent (terminal)
    FAILED = "failed"  # PrefillFailed sent (terminal)


class PEvent(enum.Enum):
    COMPUTED = "computed"  # the first token is sampled
    WRITES_DONE = "writes_done"  # no write in flight for the room
    ABORT = "abort"
    WRITE_FAILED = "write_failed"
    DEADLINE = "deadline"
    PEER_DEAD = "peer_dead"  # D silent: its writes may still be moving, wait for them
    # The transfer layer says D disconnected: no write to it can complete. Release them now
    # and tell D (alive after all?) that the room failed, so it fences rather than waits.
    PEER_LOST = "peer_lost"
    # Handling one of the room's messages raised here: the room fails like a failed write.
    LOCAL_FAIL = "local_fail"


D_TERMINAL = frozenset({DState.DONE, DState.RELEASED, DState.FAILED})
P_TERMINAL = frozenset({PState.DONE, PState.ABORTED, PState.FAILED})

C = Cmd
_FREE_FAIL = (C.FREE_PAGES, C.FAIL_REQUEST)

D_TABLE: dict[tuple[DState, DEvent], tuple[DState, tuple[Cmd, ...]]] = {
    (DState.PENDING, DEvent.ACCEPT): (DState.PREFILLING, ()),
    (DState.PENDING, DEvent.REJECT): (DState.FAILED, _FREE_FAIL),
    (DState.PENDING, DEvent.DONE): (DState.DONE, (C.START_DECODE,)),  # accept lost or late
    (DState.PENDING, DEvent.FAILED): (DState.FAILED, _FREE_FAIL),
    (DState.PENDING, DEvent.LOCAL_ABORT): (DState.ABORTING, (C.SEND_ABORT,)),
    (DState.PENDING, DEvent.DEADLINE): (DState.ABORTING, (C.SEND_ABORT, C.FAIL_REQUEST)),
    (DState.PENDING, DEvent.PEER_DEAD): (DState.FENCED, (C.FAIL_REQUEST,)),
    (DState.PENDING, DEvent.LOCAL_FAIL): (DState.ABORTING, (C.SEND_ABORT, C.FAIL_REQUEST)),
    (DState.PENDING, DEvent.WRITES_CANCELLED): (DState.FENCED, (C.FAIL_REQUEST,)),
    (DState.PREFILLING, DEvent.DONE): (DState.DONE, (C.START_DECODE,)),
    (DState.PREFILLING, DEvent.REJECT): (DState.FAILED, _FREE_FAIL),
    (DState.PREFILLING, DEvent.FAILED): (DState.FAILED, _FREE_FAIL),
    (DState.PREFILLING, DEvent.LOCAL_ABORT): (DState.ABORTING, (C.SEND_ABORT,)),
    (DState.PREFILLING, DEvent.DEADLINE): (DState.ABORTING, (C.SEND_ABORT, C.FAIL_REQUEST)),
    (DState.PREFILLING, DEvent.PEER_DEAD): (DState.FENCED, (C.FAIL_REQUEST,)),
    (DState.PREFILLING, DEvent.LOCAL_FAIL): (DState.ABORTING, (C.SEND_ABORT, C.FAIL_REQUEST)),
    (DState.PREFILLING, DEvent.WRITES_CANCELLED): (DState.FENCED, (C.FAIL_REQUEST,)),
    # Any word from P that it no longer writes releases the pages.
    (DState.ABORTING, DEvent.ABORT_ACK): (DState.RELEASED, (C.FREE_PAGES,)),
    (DState.ABORTING, DEvent.DONE): (DState.RELEASED, (C.FREE_PAGES,)),
    (DState.ABORTING, DEvent.FAILED): (DState.RELEASED, (C.FREE_PAGES,)),
    (DState.ABORTING, DEvent.REJECT): (DState.RELEASED, (C.FREE_PAGES,)),
    (DState.ABORTING, DEvent.DEADLINE): (DState.FENCED, ()),
    (DState.ABORTING, DEvent.PEER_DEAD): (DState.FENCED, ()),
    (DState.ABORTING, DEvent.WRITES_CANCELLED): (DState.FENCED, ()),
    (DState.FENCED, DEvent.FENCE_EXPIRED): (DState.RELEASED, (C.FREE_PAGES,)),
    (DState.FENCED, DEvent.ABORT_ACK): (DState.RELEASED, (C.FREE_PAGES,)),
    (DState.FENCED, DEvent.DONE): (DState.RELEASED, (C.FREE_PAGES,)),
    (DState.FENCED, DEvent.FAILED): (DState.RELEASED, (C.FREE_PAGES,)),
    (DState.FENCED, DEvent.REJECT): (DState.RELEASED, (C.FREE_PAGES,)),
}

P_TABLE: dict[tuple[PState, PEvent], tuple[PState, tuple[Cmd, ...]]] = {
    (PState.PREFILLING, PEvent.COMPUTED): (PState.WRITING, (C.SEND_FIRST_TOKEN,)),
    (PState.PREFILLING, PEvent.ABORT): (PState.ABORTING, (C.STOP_COMPUTE,)),
    (PState.PREFILLING, PEvent.WRITE_FAILED): (PState.FAILING, (C.STOP_COMPUTE,)),
    (PState.PREFILLING, PEvent.DEADLINE): (PState.FAILING, (C.STOP_COMPUTE,)),
    (PState.PREFILLING, PEvent.PEER_DEAD): (PState.ABORTING, (C.STOP_COMPUTE,)),
    (PState.PREFILLING, PEvent.LOCAL_FAIL): (PState.FAILING, (C.STOP_COMPUTE,)),
    (PState.WRITING, PEvent.WRITES_DONE): (PState.DONE, (C.SEND_DONE, C.FREE_PAGES)),
    (PState.WRITING, PEvent.ABORT): (PState.ABORTING, ()),
    (PState.WRITING, PEvent.WRITE_FAILED): (PState.FAILING, ()),
    (PState.WRITING, PEvent.DEADLINE): (PState.FAILING, ()),
    (PState.WRITING, PEvent.PEER_DEAD): (PState.ABORTING, ()),
    (PState.WRITING, PEvent.LOCAL_FAIL): (PState.FAILING, ()),
    (PState.ABORTING, PEvent.WRITES_DONE): (PState.ABORTED, (C.SEND_ABORT_ACK, C.FREE_PAGES)),
    (PState.ABORTING, PEvent.DEADLINE): (
        PState.ABORTED,
        (C.CANCEL_WRITES, C.SEND_ABORT_ACK, C.FREE_PAGES),
    ),
    (PState.FAILING, PEvent.WRITES_DONE): (PState.FAILED, (C.SEND_FAILED, C.FREE_PAGES)),
    (PState.FAILING, PEvent.ABORT): (PState.ABORTING, ()),
    (PState.FAILING, PEvent.DEADLINE): (
        PState.FAILED,
        (C.CANCEL_WRITES, C.SEND_FAILED, C.FREE_PAGES),
    ),
    (PState.PREFILLING, PEvent.PEER_LOST): (
        PState.FAILED,
        (C.STOP_COMPUTE, C.CANCEL_WRITES, C.SEND_FAILED, C.FREE_PAGES),
    ),
    (PState.WRITING, PEvent.PEER_LOST): (
        PState.FAILED,
        (C.CANCEL_WRITES, C.SEND_FAILED, C.FREE_PAGES),
    ),
    (PState.ABORTING, PEvent.PEER_LOST): (
        PState.ABORTED,
        (C.CANCEL_WRITES, C.SEND_ABORT_ACK, C.FREE_PAGES),
    ),
    (PState.FAILING, PEvent.PEER_LOST): (
        PState.FAILED,
        (C.CANCEL_WRITES, C.SEND_FAILED, C.FREE_PAGES),
    ),
}


@dataclass(frozen=True)
class Outcome:
    state: DState | PState
    commands: tuple[Cmd, ...]
    stale: bool = False  # the event did not apply; dropped and counted by the caller


def step_d(state: DState, event: DEvent) -> Outcome:
    hit = D_TABLE.get((state, event))
    if hit is None:
        return Outcome(state, (), stale=True)
    return Outcome(*hit)


def step_p(state: PState, event: PEvent) -> Outcome:
    hit = P_TABLE.get((state, event))
    if hit is None:
        return Outcome(state, (), stale=True)
    return Outcome(*hit)
