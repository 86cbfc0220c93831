"""The prefill and decode roles driven against each other in one process, without sockets.

Each test runs a real request through both engines (tests/worker/wire.py) and checks what a
client would see and that both pools end with no page held and no lease out of step.
"""

from __future__ import annotations

import time
from functools import partial

import pytest

from pdserve.engine.offline import build_engine, generate
from pdserve.kvcache.lease import LeaseState
from pdserve.protocol import messages as m
from pdserve.protocol.rooms import Cmd, DState, PEvent, PState
from pdserve.protocol.sampling import SamplingParams
from pdserve.runtime.timing import FENCE_MARGIN_S, FENCE_S, PEER_SILENCE_S, PEER_TIMEOUT_S
from tests.worker import wire as wire_module
from tests.worker.wire import P_ADDR, Wire, ended, tokens

PROMPT = [(i * 7) % 200 + 3 for i in range(37)]  # crosses pages (4) and chunks (16)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
def wire(tiny_dir):
    return Wire(tiny_dir)


def test_a_request_through_both_roles_matches_colocated(wire, tiny_dir):
    outs = wire.submit("r1", PROMPT, GREEDY)
    wire.run_until(lambda: ended(outs))
    assert outs[-1].finish_reason == "length", outs[-1]
    colocated = build_engine(tiny_dir, page_size=4, max_batched_tokens=16, kv_budget_mb=4.0)
    assert tokens(outs) == generate(colocated, [PROMPT], GREEDY)[0]
    assert [s for s in wire.sent if s[1] not in ("Ping", "Pong")] == [
        ("d>p", "Hello"),
        ("p>d", "HelloAck"),
        ("d>p", "Register"),
        ("p>d", "RegisterAck"),
        ("d>p", "PrefillRequest"),
        ("p>d", "PrefillAccept"),
        ("p>d", "FirstToken"),  # its writes were in flight when P sampled it
        ("p>d", "PrefillDone"),
    ]
    assert wire.p_role.stats.done == 1 and wire.d_role.stats.done == 1
    assert wire.idle() and wire.violations() == []


def test_the_second_request_skips_registration(wire):
    first = wire.submit("a", PROMPT, GREEDY)
    wire.run_until(lambda: ended(first))
    second = wire.submit("b", PROMPT[:9], GREEDY)
    wire.run_until(lambda: ended(second))
    assert [t for d, t in wire.sent if d == "d>p" and t != "Ping"] == [
        "Hello",
        "Register",
        "PrefillRequest",
        "PrefillRequest",
    ]
    assert wire.idle()


def _d_room(wire: Wire):
    rooms = list(wire.d_role.by_room.values())
    return rooms[0] if rooms else None


def _p_room(wire: Wire):
    rooms = list(wire.p_role.by_room.values())
    return rooms[0] if rooms else None


ABORT_POINTS = {
    # D waits for destination pages (another lease holds them all): nothing reached P
    "admitting": lambda w, outs: bool(w.d_role.admitting),
    # the room is open, its Register is on its way: P has not accepted yet
    "pending": lambda w, outs: (r := _d_room(w)) is not None and r.state is DState.PENDING,
    # P accepted and is computing chunks (a long prompt in chunks of 16)
    "prefilling": lambda w, outs: (
        (r := _d_room(w)) is not None
        and r.state is DState.PREFILLING
        and (p := _p_room(w)) is not None
        and p.state is PState.PREFILLING
    ),
    # the request decodes on D
    "decoding": lambda w, outs: len(tokens(outs)) >= 2,
}


@pytest.mark.parametrize("point", list(ABORT_POINTS))
def test_an_abort_in_each_state_ends_the_request_and_frees_both_pools(wire, point):
    prompt = PROMPT * 4 if point == "prefilling" else PROMPT  # 148 tokens: ten chunks
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    hog = wire.d.leases.open("hog", wire.d.pool.num_pages) if point == "admitting" else None
    outs = wire.submit("r", prompt, params)
    # Tick D first each round: the state is checked after each engine's own step.
    wire.run_until(lambda: ABORT_POINTS[point](wire, outs), p=point != "pending")
    wire.d.abort("r")
    wire.run_until(lambda: ended(outs) and not wire.d_role.admitting and not wire.d_role.by_room)
    if hog is not None:
        assert wire.sent == []  # it never left D
        hog.release()
    wire.run_until(wire.idle)
    assert outs[-1].finish_reason == "abort", outs[-1]
    assert wire.violations() == []
    if point in ("pending", "prefilling"):
        # D held its pages until P answered the Abort: P confirmed no write is in flight.
        assert ("d>p", "Abort") in wire.sent and ("p>d", "AbortAck") in wire.sent
    assert ("p>d", "PrefillDone") in wire.sent if point == "decoding" else True


def test_a_silent_prefill_worker_is_declared_dead_and_its_pages_fenced(wire):
    timeout_s = 20.0  # the room's write deadline: P may write until then, so D fences past it
    outs = wire.submit("r", PROMPT * 4, GREEDY, timeout_s=timeout_s)
    wire.run_until(lambda: ABORT_POINTS["prefilling"](wire, outs))
    wire.to_p = wire.to_d = False  # P vanishes: nothing reaches it, nothing comes back
    wire.run_until(lambda: not wire.d.inbox.qsize(), p=False)  # what P sent before is read
    wire.clock.advance(PEER_TIMEOUT_S)  # silent for exactly the bound: not yet dead
    wire.tick(p=False)
    assert not ended(outs) and _d_room(wire).state is DState.PREFILLING
    wire.clock.advance(0.1)
    wire.tick(p=False)  # past it: declared dead
    assert outs[-1].finish_reason == "error" and "died" in (outs[-1].error or ""), outs[-1]
    room = _d_room(wire)
    assert room is not None and room.state is DState.FENCED  # P might still write: quarantined
    # Until the write deadline (wall-clock, set when the room opened) and the margin past it.
    fence_left = room.write_deadline + FENCE_MARGIN_S - wire.clock.wall()
    assert fence_left > FENCE_S and room.deadline == pytest.approx(wire.clock.now + fence_left)
    held = wire.d.pool.allocator.num_held
    assert held > 0
    wire.clock.advance(fence_left)
    wire.tick(p=False)
    assert _d_room(wire) is room and wire.d.pool.allocator.num_held == held  # not a tick early
    wire.clock.advance(0.1)
    wire.tick(p=False)  # the fence expires
    assert _d_room(wire) is None
    assert wire.d.pool.allocator.num_held == 0 and wire.d.leases.violations() == []


def test_a_silent_decode_worker_is_dropped_and_its_rooms_freed(wire):
    wire.submit("r", PROMPT * 4, GREEDY)
    wire.run_until(lambda: ABORT_POINTS["prefilling"](wire, []))
    wire.to_p = wire.to_d = False  # D vanishes mid-prefill
    wire.run_until(lambda: not wire.p.inbox.qsize(), d=False)  # what D sent before is read
    wire.clock.advance(PEER_SILENCE_S)  # silent for exactly the bound: not yet dropped
    wire.tick(d=False)
    assert wire.p_role.stats.peers_dropped == {} and _p_room(wire) is not None
    wire.clock.advance(0.1)
    wire.tick(d=False)  # P's first tick past the silence drops D and aborts its room
    assert wire.p_role.stats.peers_dropped == {"silent": 1}
    # PEER_DEAD stops the compute and ends the room as an abort once no write is in flight.
    assert _p_room(wire) is None and wire.p_role.stats.aborted == 1
    assert wire.p_role.stats.done == 0 and not wire.p.scheduler.has_work()
    assert wire.p.pool.allocator.num_held == 0 and wire.p.leases.violations() == []


def test_prefill_peers_are_bounded_and_the_idle_one_gives_way(wire):
    from pdserve.worker.decode.peers import PrefillPeers

    wire.d_role.peers = PrefillPeers(cap=1, idle_s=60.0)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    busy = wire.submit("a", PROMPT * 4, params)
    wire.run_until(lambda: ABORT_POINTS["prefilling"](wire, busy))
    refused: list = []
    wire.d.submit("b", PROMPT, GREEDY, refused.append, prefill="tcp://elsewhere.test:1")
    wire.run_until(lambda: ended(refused))
    assert refused[-1].finish_reason == "error"
    assert "already pairs with 1 prefill workers" in (refused[-1].error or "")
    wire.run_until(lambda: ended(busy) and wire.idle())  # the busy request is unharmed
    assert busy[-1].finish_reason == "length" and wire.forgotten == []
    # P is idle now: a new address takes its place, and D closes its transport to P.
    waiting: list = []
    wire.d.submit("c", PROMPT, GREEDY, waiting.append, prefill="tcp://elsewhere.test:1")
    wire.run_until(lambda: ("d>tcp://elsewhere.test:1", "Hello") in wire.sent)
    assert wire.forgotten == [P_ADDR] and wire.d_role.peers.get(P_ADDR) is None
    # Nobody there proved it holds the cluster key: it gets no Register (no pool reference).
    assert ("d>tcp://elsewhere.test:1", "Register") not in wire.sent
    wire.d.abort("c")  # nobody answers there
    wire.run_until(lambda: ended(waiting))


def test_min_tokens_bans_a_stop_token_from_the_prefill_workers_first_token(wire, tiny_dir):
    colocated = build_engine(tiny_dir, page_size=4, max_batched_tokens=16, kv_budget_mb=4.0)
    first = generate(colocated, [PROMPT], SamplingParams(max_tokens=1, temperature=0.0))[0][0]
    params = SamplingParams(
        max_tokens=6, min_tokens=2, stop_token_ids=(first,), temperature=0.0, ignore_eos=True
    )
    want = generate(colocated, [PROMPT], params)[0]
    assert want[0] != first  # co-located: the stop token was banned at position 0
    outs = wire.submit("r", PROMPT, params)
    wire.run_until(lambda: ended(outs))
    assert tokens(outs) == want and wire.idle()


def test_seeded_sampling_gives_the_same_text_as_colocated(tiny_dir):
    """One sampling rule: P draws output position 0 and D the rest from (seed, position), so a
    seeded temperature-1 request gives co-located's tokens, seed after seed."""
    colocated = build_engine(tiny_dir, page_size=4, max_batched_tokens=16, kv_budget_mb=4.0)
    wire = Wire(tiny_dir)
    for seed in range(20):
        params = SamplingParams(
            max_tokens=5, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True,
            repetition_penalty=1.2, logit_bias=((7, 5.0),),
        )  # fmt: skip
        outs = wire.submit(f"s{seed}", PROMPT, params)
        wire.run_until(lambda outs=outs: ended(outs))
        assert tokens(outs) == generate(colocated, [PROMPT], params)[0], seed
    assert wire.idle()


def test_a_request_without_a_seed_takes_the_one_drawn_on_d_to_p(wire):
    outs = wire.submit("r", PROMPT * 4, SamplingParams(max_tokens=3, temperature=1.0))
    wire.run_until(lambda: ABORT_POINTS["prefilling"](wire, outs))
    d_room, p_room = _d_room(wire), _p_room(wire)
    assert d_room.request.params.seed is None
    assert p_room.request.seed == d_room.request.seed
    wire.run_until(lambda: ended(outs) and wire.idle())


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_prompt_logprobs_travel_with_prefill_done_and_equal_colocated(wire, tiny_dir, max_tokens):
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=2
    )
    outs = wire.submit("plp", PROMPT, params)
    wire.run_until(lambda: ended(outs))
    assert outs[-1].finish_reason == "length", outs[-1]
    assert len(tokens(outs)) == max_tokens
    colocated = build_engine(tiny_dir, page_size=4, max_batched_tokens=16, kv_budget_mb=4.0)
    local: list = []
    colocated.submit("plp", PROMPT, params, local.append)
    deadline = time.monotonic() + 60
    while not ended(local):
        assert time.monotonic() < deadline
        colocated.tick()
    assert len(outs[0].prompt_logprobs) == len(PROMPT) - 1
    assert outs[0].prompt_logprobs == local[0].prompt_logprobs
    done = m.PrefillDone(first_token=1, prompt_logprobs=outs[0].prompt_logprobs)
    assert m.decode(m.encode(done)) == done  # the control plane's codec carries them whole
    assert tokens(outs) == tokens(local)
    assert wire.idle() and wire.violations() == []


def test_a_repeated_prompt_hits_the_prefill_workers_prefix_cache(tiny_dir, monkeypatch):
    """P caches a prompt's pages when its room lets them go; the repeat prefills only its last
    token, P still writes every page D needs, and D decodes the same tokens."""
    monkeypatch.setattr(wire_module, "build_engine", partial(build_engine, prefix_cache=True))
    w = Wire(tiny_dir)
    outs = []
    for rid in ("first", "again"):
        outs.append(w.submit(rid, PROMPT, GREEDY))
        w.run_until(lambda: ended(outs[-1]) and not w.p_role.by_room and not w.d_role.by_room)
    colocated = build_engine(tiny_dir, page_size=4, max_batched_tokens=16, kv_budget_mb=4.0)
    assert tokens(outs[0]) == tokens(outs[1]) == generate(colocated, [PROMPT], GREEDY)[0]
    cache = w.p.prefix_cache
    assert cache is not None and cache.stats.hits == 1
    assert cache.stats.hit_tokens == 36  # 9 full pages of 4; the 37th token is computed
    assert w.p._snapshot()["prefix_cache"]["hit_tokens"] == 36
    for eng in (w.p, w.d):  # nothing held but the caches' pages, every count in step
        assert eng.pool.allocator.num_used == eng.pool.allocator.num_evictable
    assert w.violations() == [] and cache.violations() == []


def test_a_copy_of_a_live_rooms_prefill_request_is_stale_not_refused(wire, tiny_dir):
    """A duplicated or garbled copy of the PrefillRequest of a room P is computing must not
    be refused: D would fail the room and free pages that P's writes still fill (LESSONS #7)."""
    long = PROMPT * 3  # chunks of 16: several ticks of PREFILLING
    outs = wire.submit("dup", long, GREEDY)
    wire.run_until(lambda: (r := _p_room(wire)) is not None and r.state is PState.PREFILLING)
    room = _p_room(wire)
    copy = m.PrefillRequest(
        room=room.room,
        epoch=room.epoch,
        prompt_ids=long,
        dst_pages=list(room.dst_pages),
        params=GREEDY,
        write_deadline=time.time() + 30,
        sender=wire_module.D_ID,
    )
    garbled = m.Unreadable(room=room.room, epoch=room.epoch, of="PrefillRequest", detail="x")
    for msg in (copy, garbled):
        wire.p.inbox.put(wire_module.Inbound(wire_module.D_ID, msg))
    wire.run_until(lambda: ended(outs))
    assert ("p>d", "PrefillReject") not in wire.sent
    assert wire.p_role.stats.stale["PrefillRequest"] == 2
    assert outs[-1].finish_reason == "length"
    colocated = build_engine(tiny_dir, page_size=4, max_batched_tokens=16, kv_budget_mb=4.0)
    assert tokens(outs) == generate(colocated, [long], GREEDY)[0]
    assert wire.idle() and wire.violations() == []


@pytest.fixture
def start_decode_raises():
    from pdserve.runtime.faults import FAULTS

    FAULTS.configure("d.start_decode=raise", 0)
    yield
    FAULTS.configure("", 0)


def test_a_decode_that_cannot_start_fails_its_request_and_frees_its_pages(
    wire, start_decode_raises
):
    """START_DECODE raising (the fault point) used to leave the request in no scheduler and its
    pages leased for ever, and the finished room in D's table."""
    outs = wire.submit("nostart", PROMPT, GREEDY)
    wire.run_until(lambda: ended(outs))
    assert outs[-1].finish_reason == "error", outs[-1]
    wire.run_until(wire.idle)
    assert wire.violations() == [] and not wire.d_role.has_work()


def test_a_first_token_d_cannot_take_fails_only_that_request(wire, monkeypatch):
    """D adopts the request, then taking P's first token raises (a grammar that refuses it):
    the request fails at once and its pages go back, instead of waiting for its deadline."""
    real = wire.d.emit_token
    refused: list[str] = []

    def emit(req, tok, lp, now):
        if not req.output_ids and not refused:
            refused.append(req.request_id)
            raise ValueError("token refused by the test")
        return real(req, tok, lp, now)

    monkeypatch.setattr(wire.d, "emit_token", emit)
    bad = wire.submit("bad", PROMPT, GREEDY)
    wire.run_until(lambda: ended(bad))
    assert bad[-1].finish_reason == "error" and "refused by the test" in (bad[-1].error or "")
    good = wire.submit("good", PROMPT[:9], GREEDY)
    wire.run_until(lambda: ended(good))
    assert good[-1].finish_reason == "length"
    wire.run_until(wire.idle)
    assert wire.violations() == []


def test_a_prefill_rooms_pages_reach_it_before_its_prompt_counts_as_computed(wire, monkeypatch):
    """P's request leaves the batch as an effect (KeepPages): its lease reaches the room
    (`kept`) before COMPUTED, so the FREE_PAGES that follows (no write left) releases it."""
    computed: list[tuple[str, bool, bool]] = []
    freed: list[tuple[str, bool]] = []
    apply, run = wire.p_role._apply, wire.p_role._run_command

    def on_apply(room, event, now, reason=""):
        if event is PEvent.COMPUTED:
            live = room.lease is not None and room.lease.state is LeaseState.LIVE
            computed.append((room.request.request_id, live, room.request.status.finished))
        apply(room, event, now, reason)

    def on_command(room, c):
        if c is Cmd.FREE_PAGES:
            freed.append((room.request.request_id, room.lease is not None))
        run(room, c)

    monkeypatch.setattr(wire.p_role, "_apply", on_apply)
    monkeypatch.setattr(wire.p_role, "_run_command", on_command)
    outs = {"a": wire.submit("a", PROMPT, GREEDY), "b": wire.submit("b", PROMPT[:9], GREEDY)}
    wire.run_until(lambda: all(ended(o) for o in outs.values()))
    assert all(o[-1].finish_reason == "length" for o in outs.values())
    assert len(computed) == 2 and all(live and done for _, live, done in computed), computed
    assert [rid for rid, _ in freed] == [rid for rid, _, _ in computed]
    assert all(held for _, held in freed), freed
    wire.run_until(wire.idle)
    assert wire.violations() == []


def test_a_decode_the_scheduler_refuses_fails_only_that_request(wire, monkeypatch, tiny_dir):
    """D's Adopt raising (the scheduler refuses the request) releases the room's pages and
    fails that request alone; the next one decodes as co-located."""
    real = wire.d.scheduler.adopt

    def adopt(req, lease):
        if req.request_id == "bad":
            raise ValueError("refused by the test")
        real(req, lease)

    monkeypatch.setattr(wire.d.scheduler, "adopt", adopt)
    bad = wire.submit("bad", PROMPT, GREEDY)
    good = wire.submit("good", PROMPT[:9], GREEDY)
    wire.run_until(lambda: ended(bad) and ended(good))
    assert bad[-1].finish_reason == "error"
    assert bad[-1].error == "its decode could not start: ValueError: refused by the test"
    assert good[-1].finish_reason == "length"
    # A transfer counts as complete once its request decodes: the refused one does not.
    assert wire.d_role.stats.done == 1
    registry = wire.d.metrics.registry
    for name in ("kv_bytes", "kv_transfer_seconds", "kv_wait_seconds"):
        assert registry.get_sample_value(f"pdserve_pd_{name}_count") == 1, name
    colocated = build_engine(tiny_dir, page_size=4, max_batched_tokens=16, kv_budget_mb=4.0)
    assert tokens(good) == generate(colocated, [PROMPT[:9]], GREEDY)[0]
    wire.run_until(wire.idle)
    assert wire.violations() == [] and not wire.d_role.has_work()


def test_a_prefill_room_whose_pages_cannot_be_taken_fails_at_once(wire, monkeypatch):
    """P's `kept` raises (its COMPUTED, here): the request has left the batch already, yet its
    room fails at once (not at its deadline: the clock stands still), its pages are released
    and D's request fails; the next one is served as usual."""
    apply = wire.p_role._apply
    refused: list[str] = []

    def on_apply(room, event, now, reason=""):
        if event is PEvent.COMPUTED and not refused:
            refused.append(room.request.request_id)
            raise RuntimeError("COMPUTED refused by the test")
        apply(room, event, now, reason)

    monkeypatch.setattr(wire.p_role, "_apply", on_apply)
    bad = wire.submit("bad", PROMPT, GREEDY)
    wire.run_until(lambda: ended(bad))
    assert bad[-1].finish_reason == "error"
    assert "it could not leave the batch: RuntimeError: COMPUTED refused" in bad[-1].error
    assert wire.p_role.stats.failed == 1 and not wire.p_role.by_room
    assert wire.p.pool.allocator.num_held == 0
    good = wire.submit("good", PROMPT[:9], GREEDY)
    wire.run_until(lambda: ended(good))
    assert good[-1].finish_reason == "length"
    wire.run_until(wire.idle)
    assert wire.violations() == []


def test_a_prefill_request_that_could_not_leave_the_batch_is_asked_out_again(wire, monkeypatch):
    """Ending P's request for its KeepPages raises: the request is still in the batch, so its
    failing room asks it out again (STOP_COMPUTE), rather than leave it to run on."""
    real = wire.p.finish
    calls: list[tuple[str, str, str | None]] = []

    def finish(req, event, error=None, **kw):
        calls.append((req.request_id, event.value, kw.get("keep_pages_for")))
        if len(calls) == 1:
            raise RuntimeError("cannot end it by the test")
        return real(req, event, error, **kw)

    monkeypatch.setattr(wire.p, "finish", finish)
    bad = wire.submit("bad", PROMPT, GREEDY)
    wire.run_until(lambda: ended(bad))
    assert bad[-1].finish_reason == "error"
    assert "it could not leave the batch: RuntimeError: cannot end it" in bad[-1].error
    (rid, first, owner), (again, event, kept_for) = calls
    assert (first, again, event, kept_for) == ("stop", rid, "abort", owner) and owner
    wire.run_until(wire.idle)
    assert wire.p.scheduler.get(rid) is None and wire.violations() == []
