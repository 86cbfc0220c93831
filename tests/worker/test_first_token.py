"""P's first token reaches D's client before the KV does (protocol FirstToken, engine/role.py
StreamFirst): the prefill and decode roles against each other in one process (tests/worker/
wire.py), with P's PrefillDone held back so that D still waits for its KV."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.engine.offline import build_engine, generate
from pdserve.protocol import messages as m
from pdserve.protocol.rooms import DState
from pdserve.protocol.sampling import SamplingParams
from pdserve.transfer.control import Inbound
from tests.worker.wire import Wire, ended, tokens

PROMPT = [(i * 7) % 200 + 3 for i in range(37)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
def wire(tiny_dir):
    return Wire(tiny_dir)


def hold(wire: Wire, kind: type[m.Msg]) -> list[Inbound]:
    """Keep D's inbound messages of `kind` out of its inbox; returns where they wait."""
    held: list[Inbound] = []
    put = wire.d.inbox.put

    def maybe(item: Inbound) -> None:
        if isinstance(item, Inbound) and isinstance(item.msg, kind):
            held.append(item)
        else:
            put(item)

    wire.d.inbox.put = maybe  # type: ignore[method-assign]
    return held


def release(wire: Wire, held: list[Inbound]) -> None:
    """Stop holding, and hand D what was held."""
    del wire.d.inbox.put  # the queue's own put again
    for item in held:
        wire.d.inbox.put(item)


def colocated(tiny_dir, params: SamplingParams) -> list[int]:
    engine = build_engine(tiny_dir, page_size=4, max_batched_tokens=16, kv_budget_mb=4.0)
    return generate(engine, [PROMPT], params)[0]


def test_the_first_token_is_streamed_while_d_still_waits_for_the_kv(wire, tiny_dir):
    done = hold(wire, m.PrefillDone)
    outs = wire.submit("r", PROMPT, GREEDY)
    wire.run_until(lambda: bool(done))
    wire.run_until(lambda: bool(outs), max_ticks=10)
    room = next(iter(wire.d_role.by_room.values()))
    assert room.state is DState.PREFILLING  # no PrefillDone: the KV has not been taken
    assert wire.d.scheduler.get("r") is None  # not decoding
    expected = colocated(tiny_dir, GREEDY)
    assert outs[0].token_ids == (expected[0],) and outs[0].finish_reason is None
    release(wire, done)
    wire.run_until(lambda: ended(outs))
    assert tokens(outs) == expected  # the first token once, then the rest
    wire.run_until(wire.idle)
    assert wire.violations() == []


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),  # it ends the request
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1),
    ],
    ids=["last-token", "prompt-logprobs"],
)
def test_a_first_token_that_ends_the_request_or_needs_the_kv_waits_for_it(wire, tiny_dir, params):
    done = hold(wire, m.PrefillDone)
    outs = wire.submit("r", PROMPT, params)
    wire.run_until(lambda: bool(done))
    for _ in range(5):
        wire.tick()
    assert outs == []  # FirstToken came, and D kept the token for its PrefillDone
    assert ("p>d", "FirstToken") in wire.sent
    release(wire, done)
    wire.run_until(lambda: ended(outs))
    assert tokens(outs) == colocated(tiny_dir, params)
    if params.prompt_logprobs:
        assert len(outs[0].prompt_logprobs) == len(PROMPT) - 1
    wire.run_until(wire.idle)


def test_a_prefill_done_that_contradicts_the_streamed_token_fails_the_request(wire):
    """P said one first token and then another: the request fails, saying so, and its pages
    go back; the client never gets a second first token."""
    done = hold(wire, m.PrefillDone)
    outs = wire.submit("r", PROMPT, GREEDY)
    wire.run_until(lambda: bool(done) and bool(outs))
    streamed = outs[0].token_ids[0]
    other = (streamed + 1) % 200
    done[0] = Inbound(done[0].peer, msgspec.structs.replace(done[0].msg, first_token=other))
    release(wire, done)
    wire.run_until(lambda: ended(outs))
    assert outs[-1].finish_reason == "error"
    assert f"first token {other} is not the [{streamed}] streamed" in (outs[-1].error or "")
    assert tokens(outs) == [streamed]
    wire.run_until(wire.idle)
    assert wire.violations() == []


def test_a_first_token_for_a_room_that_is_not_waiting_is_dropped(wire, tiny_dir):
    """A FirstToken after the PrefillDone (or a copy of one) streams nothing a second time."""
    outs = wire.submit("r", PROMPT, GREEDY)
    wire.run_until(lambda: ended(outs))
    expected = colocated(tiny_dir, GREEDY)
    assert tokens(outs) == expected
    outs2 = wire.submit("r2", PROMPT, GREEDY)
    firsts = hold(wire, m.FirstToken)
    wire.run_until(lambda: ended(outs2))
    del wire.d.inbox.put
    for item in firsts:  # after its PrefillDone: stale
        wire.d.inbox.put(item)
    wire.run_until(wire.idle)
    for _ in range(3):
        wire.tick()
    assert len(firsts) == 1 and wire.d_role.stats.stale["FirstToken"] == 1
    assert tokens(outs2) == expected


def test_a_request_aborted_after_its_streamed_first_token_decodes_nothing(wire):
    """The client leaves once it has the first token, while D still waits for the KV: the
    room ends when P's PrefillDone comes, and D counts no KV as decoded on (the chaos check
    `bytes_acked <= bytes_written` reads this figure)."""
    done = hold(wire, m.PrefillDone)
    outs = wire.submit("r", PROMPT, GREEDY)
    wire.run_until(lambda: bool(done) and bool(outs))
    wire.d.abort("r")
    release(wire, done)
    wire.run_until(lambda: ended(outs) and not wire.d_role.by_room)
    wire.run_until(wire.idle)
    assert outs[-1].finish_reason == "abort" and len(tokens(outs)) == 1
    assert wire.d_role.stats.bytes_acked == 0 and wire.d_role.stats.done == 0
    assert wire.violations() == []
