"""Both room tables cell by cell against an explicit list, and the lease rules as properties."""

from __future__ import annotations

from pdserve.protocol.rooms import (
    D_TABLE,
    D_TERMINAL,
    P_TABLE,
    P_TERMINAL,
    Cmd,
    DEvent,
    DState,
    PEvent,
    PState,
    step_d,
    step_p,
)

C = Cmd

# Every legal cell of both tables, written out here on purpose: a change to a table has to be
# made a second time, deliberately, in this list. Every cell not listed is illegal: stale.
D_CELLS = {
    (DState.PENDING, DEvent.ACCEPT): (DState.PREFILLING, ()),
    (DState.PENDING, DEvent.REJECT): (DState.FAILED, (C.FREE_PAGES, C.FAIL_REQUEST)),
    (DState.PENDING, DEvent.DONE): (DState.DONE, (C.START_DECODE,)),
    (DState.PENDING, DEvent.FAILED): (DState.FAILED, (C.FREE_PAGES, C.FAIL_REQUEST)),
    (DState.PENDING, DEvent.LOCAL_ABORT): (DState.ABORTING, (C.SEND_ABORT,)),
    (DState.PENDING, DEvent.DEADLINE): (DState.ABORTING, (C.SEND_ABORT, C.FAIL_REQUEST)),
    (DState.PENDING, DEvent.PEER_DEAD): (DState.FENCED, (C.FAIL_REQUEST,)),
    (DState.PENDING, DEvent.LOCAL_FAIL): (DState.ABORTING, (C.SEND_ABORT, C.FAIL_REQUEST)),
    (DState.PENDING, DEvent.WRITES_CANCELLED): (DState.FENCED, (C.FAIL_REQUEST,)),
    (DState.PREFILLING, DEvent.DONE): (DState.DONE, (C.START_DECODE,)),
    (DState.PREFILLING, DEvent.REJECT): (DState.FAILED, (C.FREE_PAGES, C.FAIL_REQUEST)),
    (DState.PREFILLING, DEvent.FAILED): (DState.FAILED, (C.FREE_PAGES, C.FAIL_REQUEST)),
    (DState.PREFILLING, DEvent.LOCAL_ABORT): (DState.ABORTING, (C.SEND_ABORT,)),
    (DState.PREFILLING, DEvent.DEADLINE): (DState.ABORTING, (C.SEND_ABORT, C.FAIL_REQUEST)),
    (DState.PREFILLING, DEvent.PEER_DEAD): (DState.FENCED, (C.FAIL_REQUEST,)),
    (DState.PREFILLING, DEvent.LOCAL_FAIL): (DState.ABORTING, (C.SEND_ABORT, C.FAIL_REQUEST)),
    (DState.PREFILLING, DEvent.WRITES_CANCELLED): (DState.FENCED, (C.FAIL_REQUEST,)),
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
P_CELLS = {
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


def test_the_d_table_is_exactly_these_cells_and_every_other_one_is_stale():
    assert D_TABLE == D_CELLS
    for state in DState:
        for event in DEvent:
            out = step_d(state, event)
            if (state, event) in D_CELLS:
                assert not out.stale and (out.state, out.commands) == D_CELLS[(state, event)]
            else:
                assert out.stale and out.state is state and out.commands == (), (state, event)


def test_the_p_table_is_exactly_these_cells_and_every_other_one_is_stale():
    assert P_TABLE == P_CELLS
    for state in PState:
        for event in PEvent:
            out = step_p(state, event)
            if (state, event) in P_CELLS:
                assert not out.stale and (out.state, out.commands) == P_CELLS[(state, event)]
            else:
                assert out.stale and out.state is state and out.commands == (), (state, event)


def test_terminal_states_are_sticky():
    assert not any(s in D_TERMINAL for s, _ in D_TABLE)
    assert not any(s in P_TERMINAL for s, _ in P_TABLE)


def test_every_non_terminal_state_has_a_deadline():
    for s in DState:
        if s not in D_TERMINAL:
            assert (s, DEvent.DEADLINE) in D_TABLE or (s, DEvent.FENCE_EXPIRED) in D_TABLE, s
    for s in PState:
        if s not in P_TERMINAL:
            assert (s, PEvent.DEADLINE) in P_TABLE, s


def test_every_non_terminal_state_can_be_aborted_or_is_already_ending():
    for s in (DState.PENDING, DState.PREFILLING):
        assert D_TABLE[(s, DEvent.LOCAL_ABORT)][0] is DState.ABORTING
    for s in (PState.PREFILLING, PState.WRITING, PState.FAILING):
        assert P_TABLE[(s, PEvent.ABORT)][0] is PState.ABORTING


def test_d_frees_pages_only_after_p_stopped_writing_or_fence():
    """FREE_PAGES on D only on events that prove P no longer writes."""
    safe = {DEvent.ABORT_ACK, DEvent.DONE, DEvent.FAILED, DEvent.REJECT, DEvent.FENCE_EXPIRED}
    for (_, event), (_, cmds) in D_TABLE.items():
        if Cmd.FREE_PAGES in cmds:
            assert event in safe, event


def test_d_pages_freed_exactly_once_on_every_path():
    """From PENDING, any event sequence frees pages at most once; terminal => freed or decoding."""
    import itertools

    events = list(DEvent)
    for seq in itertools.product(events, repeat=4):
        state, frees = DState.PENDING, 0
        for ev in seq:
            out = step_d(state, ev)
            frees += Cmd.FREE_PAGES in out.commands
            state = out.state  # type: ignore[assignment]
        assert frees <= 1
        if state in (DState.RELEASED, DState.FAILED):
            assert frees == 1
        if state is DState.DONE:
            assert frees == 0  # the decoding request owns the pages now


def test_p_acks_only_without_writes_in_flight():
    for (state, event), (_, cmds) in P_TABLE.items():
        if {Cmd.SEND_ABORT_ACK, Cmd.SEND_DONE, Cmd.SEND_FAILED} & set(cmds):
            assert event is PEvent.WRITES_DONE or Cmd.CANCEL_WRITES in cmds, (state, event)
