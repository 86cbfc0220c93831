"""P's first token reaches D's client before the KV does (protocol FirstToken, engine/role.py
StreamFirst): the prefill and decode roles against each other in one process (tests/worker/
wire.py), with P's PrefillDone held back so that D still waits for its KV."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.engine.offline import build_engine, generate
from pdserve.engine.request import Request
from pdserve.protocol import messages as m
from pdserve.protocol.constraint import Constraint, ConstraintKind
from pdserve.protocol.rooms import DState
from pdserve.protocol.sampling import SamplingParams
from pdserve.transfer.control import Inbound
from tests.worker.wire import Wire, ended, tokens

PROMPT = [(i * 7) % 200 + 3 for i in range(37)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
REGEX = Constraint(kind=ConstraintKind.REGEX, spec="[a-z]+")


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
    ahead = "pdserve_pd_first_tokens_ahead_total"
    assert wire.d.metrics.registry.get_sample_value(ahead) == 1.0  # D's /metrics shows it
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
    assert wire.d_role.metrics.first_tokens_ahead == 0
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


def test_the_engines_itl_counts_decode_pace_from_the_adopt_not_the_kv_wait(wire):
    """The client's gap after an early first token includes the rest of the transfer (D's
    kv_wait says how long); the engine's ITL histogram keeps measuring decode steps."""
    done = hold(wire, m.PrefillDone)
    outs = wire.submit("r", PROMPT, GREEDY)
    wire.run_until(lambda: bool(done) and bool(outs))
    wire.clock.advance(2.0)  # the KV takes two seconds more
    release(wire, done)
    wire.run_until(lambda: ended(outs))
    wire.d.metrics.itl.flush()
    itl_sum = wire.d.metrics.registry.get_sample_value("pdserve_inter_token_latency_seconds_sum")
    assert itl_sum is not None and itl_sum < 1.0  # the fake clock stands still while it decodes


def test_a_token_outside_the_vocabulary_is_never_streamed(wire):
    """From an authenticated but broken P: a FirstToken out of range is dropped and counted; a
    PrefillDone whose token is out of range fails the room, saying so."""
    firsts = hold(wire, m.FirstToken)
    outs = wire.submit("r", PROMPT, GREEDY)
    wire.run_until(lambda: bool(firsts))
    vocab = wire.d.vocab_size
    del wire.d.inbox.put
    for bad in (-1, vocab, 2**63 - 1):
        msg = msgspec.structs.replace(firsts[0].msg, token=bad)
        wire.d.inbox.put(Inbound(firsts[0].peer, msg))
    wire.run_until(lambda: ended(outs))
    assert wire.d_role.stats.unexpected["FirstToken out of the vocabulary"] == 3
    assert outs[-1].finish_reason == "length" and all(0 <= t < vocab for t in tokens(outs))

    done = hold(wire, m.PrefillDone)
    outs2 = wire.submit("r2", PROMPT[:9], GREEDY)
    wire.run_until(lambda: bool(done))
    release(wire, [Inbound(done[0].peer, msgspec.structs.replace(done[0].msg, first_token=vocab))])
    wire.run_until(lambda: ended(outs2))
    assert outs2[-1].finish_reason == "error"
    assert f"first token {vocab} is not in the vocabulary" in (outs2[-1].error or "")
    assert all(t < vocab for t in tokens(outs2))
    wire.run_until(wire.idle)
    assert wire.violations() == []


def test_a_decode_worker_that_does_not_take_first_tokens_gets_none(wire, tiny_dir):
    """Register.first_tokens: a D from before FirstToken leaves it False, and P sends it none
    (it would drop them as an unknown type)."""
    first = wire.submit("a", PROMPT, GREEDY)
    wire.run_until(lambda: ended(first))
    assert ("p>d", "FirstToken") in wire.sent
    for peer in wire.p_role.peers.by_id.values():
        peer.first_tokens = False  # as an older D's Register pairs
    wire.sent.clear()
    second = wire.submit("b", PROMPT, GREEDY)
    wire.run_until(lambda: ended(second))
    assert ("p>d", "PrefillDone") in wire.sent and ("p>d", "FirstToken") not in wire.sent
    assert tokens(second) == colocated(tiny_dir, GREEDY)


@pytest.mark.parametrize(
    ("params", "early"),
    [
        (SamplingParams(max_tokens=4, temperature=0.0), True),
        (SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=(7,)), False),  # its token
        (SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=(8,)), True),
        (SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), True),
        (SamplingParams(max_tokens=1, temperature=0.0), False),
        (SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0), False),
        (SamplingParams(max_tokens=4, temperature=0.0, constraint=REGEX), False),
    ],
)
def test_streams_early_only_a_token_that_cannot_end_the_request(wire, params, early):
    req = Request("x", PROMPT, params, sink=lambda out: None, eos_token_ids=frozenset({2}))
    assert wire.d.streams_early(req, 7) is early
    assert wire.d.streams_early(req, 2) is (early and params.ignore_eos)  # its EOS


def test_a_prompt_one_short_of_the_context_does_not_stream_early(wire):
    long = [3] * (wire.d.max_model_len - 1)
    req = Request("x", long, GREEDY, sink=lambda out: None)
    assert not wire.d.streams_early(req, 7)  # its first token reaches max_model_len
    assert wire.d.streams_early(Request("y", long[:-1], GREEDY, sink=lambda out: None), 7)
