"""A request or room left past its deadline is reported (what /health turns red on)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from pdserve.protocol.sampling import SamplingParams
from pdserve.runtime.timing import OVERDUE_GRACE_S
from tests.helpers import make_engine


def test_nothing_is_overdue_when_deadlines_are_enforced(tiny_dir):
    eng = make_engine(tiny_dir)
    eng.submit("a", [3, 4, 5], SamplingParams(max_tokens=50), lambda o: None, timeout_s=0.01)
    time.sleep(0.02 + OVERDUE_GRACE_S)
    eng.tick()
    assert eng.overdue == () and not eng.scheduler.has_work()  # ended by its deadline


def test_a_request_the_deadline_did_not_end_is_overdue(tiny_dir, monkeypatch):
    eng = make_engine(tiny_dir)
    monkeypatch.setattr(eng, "finish", lambda *a, **k: None)  # a bug: FAIL does not end it
    eng.submit("stuck", [3, 4, 5], SamplingParams(max_tokens=50), lambda o: None, timeout_s=0.01)
    eng.tick()
    assert eng.overdue == ()  # within the grace
    time.sleep(0.02 + OVERDUE_GRACE_S)
    eng.tick()
    assert len(eng.overdue) == 1 and eng.overdue[0].startswith("request stuck (")


def test_a_room_past_its_deadline_is_overdue(tiny_dir, monkeypatch):
    eng = make_engine(tiny_dir)
    state = SimpleNamespace(value="fenced")
    room = SimpleNamespace(room=7, state=state, deadline=time.monotonic() - 2 * OVERDUE_GRACE_S)
    monkeypatch.setattr(eng.role, "rooms", lambda: [room])
    eng.tick()
    assert len(eng.overdue) == 1 and eng.overdue[0].startswith("room 7 (fenced) ")
