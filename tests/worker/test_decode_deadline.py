"""A request whose own timeout passes while P has it (issue 41 item 6: `"timeout": 0.001` in
PD mode was a 500). P refuses a write deadline already past, or fails a room whose writes
outlive it; D ends the request as its deadline's doing, which the front end answers 408, not
500. The roles run against each other in one process (tests/worker/wire.py), on a fake clock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.frontend.api import failure
from pdserve.protocol.outputs import is_deadline_error
from pdserve.protocol.rooms import DState
from pdserve.protocol.sampling import SamplingParams
from pdserve.worker.decode.rooms import blame
from tests.worker.wire import Wire, ended

PROMPT = [(i * 5) % 200 + 3 for i in range(20)]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
TIMEOUT_S = 0.3


def test_a_refusal_past_the_requests_own_deadline_is_a_408(tiny_dir):
    wire = Wire(tiny_dir)
    first = wire.submit("pair", PROMPT, GREEDY)  # pairs D with P: the next request goes at once
    wire.run_until(lambda: ended(first))
    outs = wire.submit("late", PROMPT, GREEDY, timeout_s=TIMEOUT_S)
    sent = len(wire.sent)
    wire.run_until(lambda: ("d>p", "PrefillRequest") in wire.sent[sent:], p=False)
    wire.clock.advance(TIMEOUT_S + 0.05)  # its deadline passes with its PrefillRequest at P
    wire.tick(d=False)  # P refuses it: "arrived ... after its write deadline"
    wire.tick(p=False)  # D reads the refusal before its own deadline check runs
    assert ("p>d", "PrefillReject") in wire.sent[sent:]
    assert ended(outs) and outs[-1].finish_reason == "error"
    error = outs[-1].error
    assert is_deadline_error(error) and "after its write deadline" in (error or ""), error
    assert failure(error).status == 408
    wire.run_until(wire.idle)
    assert wire.violations() == []


@pytest.mark.parametrize(
    ("deadline_in_s", "deadline_error"),
    [(-0.001, True), (0.0, True), (0.001, False), (60.0, False), (None, False)],
)
@pytest.mark.parametrize("why", ["prefill worker refused: x", "prefill failed: KV write failed"])
def test_an_end_by_p_is_the_clients_timeout_only_once_that_passed(
    deadline_in_s, deadline_error, why
):
    now = 1000.0
    deadline = None if deadline_in_s is None else now + deadline_in_s
    room = SimpleNamespace(request=SimpleNamespace(deadline=deadline), state=DState.PREFILLING)
    said = blame(room, why, now)  # type: ignore[arg-type]
    assert is_deadline_error(said) is deadline_error and why in said
    assert failure(said).status == (408 if deadline_error else 500)
