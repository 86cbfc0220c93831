"""Walk every (state, event) cell of both room tables, and check the lease rules."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("state", list(DState))
@pytest.mark.parametrize("event", list(DEvent))
def test_every_d_cell(state, event):
    out = step_d(state, event)
    if (state, event) in D_TABLE:
        assert not out.stale and (out.state, out.commands) == D_TABLE[(state, event)]
    else:
        assert out.stale and out.state is state and out.commands == ()


@pytest.mark.parametrize("state", list(PState))
@pytest.mark.parametrize("event", list(PEvent))
def test_every_p_cell(state, event):
    out = step_p(state, event)
    if (state, event) in P_TABLE:
        assert not out.stale and (out.state, out.commands) == P_TABLE[(state, event)]
    else:
        assert out.stale and out.state is state


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
