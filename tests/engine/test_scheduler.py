import random

import pytest

from pdserve.config import SchedulerConfig
from pdserve.engine.request import Event, Request, Status
from pdserve.engine.scheduler import Scheduler
from pdserve.kvcache.allocator import PageAllocator
from pdserve.kvcache.lease import LeaseError, Leases, LeaseState
from pdserve.protocol.sampling import SamplingParams


def req(rid: str, n: int, max_tokens: int = 100) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    return Request(rid, list(range(1, n + 1)), params, sink=lambda o: None)


def sched(num_pages: int, page_size: int = 4, **cfg: int) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), Leases(PageAllocator(num_pages)), page_size)


def finish_step(plan) -> None:
    """What the engine does after a forward: mark computed, append a token where sampled."""
    for c in plan.chunks:
        c.request.num_computed = c.start + c.length
        if c.samples:
            c.request.output_ids.append(7)


def test_chunked_prefill_respects_budget_then_decodes():
    s = sched(32, max_batched_tokens=8, max_running=4)
    r = req("a", 20)
    s.add(r)
    sizes = []
    for _ in range(4):
        plan = s.schedule()
        sizes.append([(c.start, c.length, c.samples) for c in plan.chunks])
        finish_step(plan)
    assert sizes[:3] == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)]]
    assert sizes[3] == [(20, 1, True)]
    assert len(r.pages) == 6  # 22 tokens of KV needed by now -> ceil(21/4)
    assert r.pages == list(range(6)) and r.lease is not None and r.lease.owner == "a"
    assert s.leases.live() == [r.lease]  # one lease, grown step by step


def test_decodes_come_first_and_budget_shared():
    s = sched(32, max_batched_tokens=6, max_running=4)
    a, b = req("a", 3), req("b", 10)
    s.add(a)
    finish_step(s.schedule())  # a prefilled, now decoding
    s.add(b)
    plan = s.schedule()
    assert [(c.request.request_id, c.length) for c in plan.chunks] == [("a", 1), ("b", 5)]


def full_pool_of_two():
    s = sched(4, max_batched_tokens=64, max_running=4)
    a, b = req("a", 7), req("b", 7)
    s.add(a)
    s.add(b)
    finish_step(s.schedule())  # both prefilled: 2 pages each, pool full
    finish_step(s.schedule())  # token 9 fits page 2 for both; both need a third next
    return s, s.allocator, a, b


def test_preemption_by_recompute_releases_the_lease_and_requeues_first():
    s, alloc, a, b = full_pool_of_two()
    assert alloc.num_free == 0
    b_lease = b.lease
    plan = s.schedule()  # a needs a third page: b (latest) is preempted
    assert [c.request.request_id for c in plan.chunks] == ["a"]
    assert plan.preempted == [b] and b.status is Status.WAITING and b.num_computed == 0
    assert s.waiting[0] is b and b.pages == [] and b.output_ids == [7, 7]
    assert b.lease is None and b_lease is not None and b_lease.state is LeaseState.RELEASED
    assert alloc.num_used == 3 and s.leases.live() == [a.lease] and s.leases.violations() == []


def test_a_preempted_request_gets_a_new_lease_when_it_runs_again():
    s, alloc, a, b = full_pool_of_two()
    s.schedule()  # b preempted
    s.finish(a, Event.STOP)
    plan = s.schedule()
    assert [c.request for c in plan.chunks] == [b] and b.lease is not None and b.lease.live
    assert len(b.pages) == 3 and s.leases.live() == [b.lease]  # 9 tokens recomputed: 3 pages


def test_a_pinned_request_is_never_the_victim():
    s, alloc, a, b = full_pool_of_two()
    s.pinned = lambda r: r is b  # b's pages are being read by a KV transfer
    plan = s.schedule()
    assert plan.preempted == [a] and [c.request for c in plan.chunks] == [b]
    assert len(b.pages) == 3 and a.pages == [] and s.waiting[0] is a


def test_when_every_candidate_is_pinned_requests_wait_instead():
    s, alloc, a, b = full_pool_of_two()
    s.pinned = lambda r: True
    plan = s.schedule()
    assert plan.chunks == [] and plan.preempted == []
    assert len(a.pages) == len(b.pages) == 2 and s.running == [a, b]
    s.pinned = lambda r: False  # the transfer completed: normal preemption resumes
    plan = s.schedule()
    assert plan.preempted == [b] and [c.request for c in plan.chunks] == [a]


def test_a_request_planned_this_step_is_never_the_victim():
    s = sched(5, max_batched_tokens=64, max_running=4)
    a, b, c = req("a", 2), req("b", 7), req("c", 7)
    for r in (a, b, c):
        s.add(r)
    finish_step(s.schedule())  # 1 + 2 + 2 pages: the pool is full
    finish_step(s.schedule())
    s.pinned = lambda r: r is not a  # b and c need a third page; only a could give way
    plan = s.schedule()  # a is planned first (its page has room): it must not be preempted
    assert [c.request for c in plan.chunks] == [a] and plan.preempted == []
    assert s.running == [a, b, c] and a.lease is not None and a.lease.live
    assert s.leases.violations() == []


def test_finish_releases_pages_once():
    s = sched(8)
    a = req("a", 5)
    s.add(a)
    finish_step(s.schedule())
    lease = a.lease
    s.finish(a, Event.ABORT)
    assert s.allocator.num_free == 8 and a.status is Status.FINISHED_ABORTED and not s.has_work()
    assert a.lease is None and lease is not None and lease.state is LeaseState.RELEASED
    assert len(s.leases) == 0


def test_finish_of_a_request_that_never_held_pages():
    s = sched(8)
    a = req("a", 5)
    s.add(a)
    s.finish(a, Event.ABORT)
    assert a.status is Status.FINISHED_ABORTED and a.lease is None and len(s.leases) == 0


def test_hand_over_finishes_the_request_and_gives_its_pages_to_the_caller():
    s = sched(8)
    a = req("a", 5)
    s.add(a)
    finish_step(s.schedule())
    pages = a.pages
    kept = s.hand_over(a, Event.STOP, "room 9")
    assert kept is not None and kept.owner == "room 9" and list(kept.pages) == pages == [0, 1]
    assert a.status is Status.FINISHED_STOPPED and a.lease is None and not s.has_work()
    assert s.allocator.num_used == 2 and s.leases.live() == [kept]
    kept.release()
    assert s.allocator.num_free == 8 and len(s.leases) == 0


def test_hand_over_of_a_waiting_request_gives_nothing():
    s = sched(8)
    a = req("a", 5)
    s.add(a)
    assert s.hand_over(a, Event.ABORT, "room 9") is None
    assert a.status is Status.FINISHED_ABORTED and not s.has_work()


def test_adopt_makes_the_lease_the_requests():
    s = sched(8)
    room = s.leases.open("room 1", 2)
    a = req("a", 5)
    a.num_computed = 5
    s.adopt(a, room.hand_over("a"))
    assert a.status is Status.RUNNING and a.pages == [0, 1] and s.running == [a]
    s.finish(a, Event.STOP)
    assert s.allocator.num_free == 8 and len(s.leases) == 0


def test_adopt_refuses_a_request_that_holds_a_lease():
    s = sched(8)
    a = req("a", 5)
    a.lease = s.leases.open("a", 1)
    with pytest.raises(ValueError, match=r"^request a adopted while it holds Lease\('a', 1 pages"):
        s.adopt(a, s.leases.open("room", 2))
    assert a.status is Status.WAITING and s.running == []


def test_leased_pages_cannot_be_set_by_hand():
    s = sched(8)
    a = req("a", 5)
    s.add(a)
    s.schedule()
    with pytest.raises(LeaseError, match=r"^request a: its pages belong to Lease\('a', 2 pages"):
        a.pages = []
    assert a.pages == [0, 1]


def test_max_running_caps_admission():
    s = sched(64, max_batched_tokens=100, max_running=2)
    for i in range(3):
        s.add(req(f"r{i}", 3))
    plan = s.schedule()
    assert len(plan.chunks) == 2 and len(s.waiting) == 1


def test_random_workloads_keep_leases_exact_and_leak_nothing():
    """Admit, grow, preempt, pin, finish, abort and hand over in a seeded random order; after
    every step each page's count is the number of live leases holding it, every chunk runs on
    pages its request holds (and samples iff it reaches its last token), a running request's
    lease covers exactly its computed tokens, and a waiting one holds none."""
    rng = random.Random(3)
    s = sched(16, max_batched_tokens=16, max_running=6)
    kept = []  # leases handed over to a "room", released some steps later
    pinned: set[str] = set()
    s.pinned = lambda r: r.request_id in pinned
    preempted = 0
    for step in range(2500):
        op = rng.random()
        live = s.running + list(s.waiting)
        if op < 0.1:
            s.add(req(f"r{step}", rng.randint(1, 16), max_tokens=rng.randint(1, 40)))
        elif op < 0.13 and live:
            s.finish(rng.choice(live), Event.ABORT)
        elif op < 0.16 and live:
            r = rng.choice(live)
            event = Event.STOP if r.status is Status.RUNNING else Event.ABORT
            lease = s.hand_over(r, event, f"room {step}")
            if lease is not None:
                kept.append(lease)
        elif op < 0.2 and kept:
            kept.pop(rng.randrange(len(kept))).release()
        elif op < 0.25:
            pinned = {r.request_id for r in s.running if rng.random() < 0.3}
        else:
            plan = s.schedule()
            preempted += len(plan.preempted)
            for c in plan.chunks:  # every chunk runs on pages its request holds
                assert c.request.status is Status.RUNNING, step
                assert c.request.num_pages * 4 >= c.start + c.length, step
                # and samples exactly when it reaches its request's last token
                assert c.samples == (c.start + c.length == c.request.num_tokens), step
            finish_step(plan)
            for r in list(s.running):
                if len(r.output_ids) >= r.params.max_tokens:
                    s.finish(r, Event.LENGTH)
            for r in s.running:
                assert r.lease is not None and r.lease.live
                assert r.num_pages == -(-r.num_computed // 4)
        for r in s.waiting:
            assert r.lease is None
        held = [lease.owner for lease in s.leases.live()]
        assert sorted(held) == sorted(
            [r.request_id for r in s.running] + [lease.owner for lease in kept]
        )
        assert s.leases.violations() == [], step
    assert preempted > 50  # the pool was tight enough to exercise preemption
    for r in s.running + list(s.waiting):
        s.finish(r, Event.ABORT)
    for lease in kept:
        lease.release()
    assert s.allocator.num_free == 16 and len(s.leases) == 0 and s.leases.violations() == []


def test_a_request_preempted_with_its_last_token_in_flight_comes_back_without_sampling():
    """Overlapped scheduling: b's last token (max_tokens) is still in flight when a needs a
    page and b, the newest, is preempted; b is admitted again in the same step with nothing to
    compute, and its chunk must not sample (its token is already on its way)."""
    s = sched(4, max_batched_tokens=64, max_running=4)
    a, b = req("a", 7), req("b", 7, max_tokens=2)
    s.add(a)
    s.add(b)
    finish_step(s.schedule())  # both prompts (2 pages each); a first token each
    for c in s.schedule().chunks:  # launched, not completed: b's second token is its last
        c.request.num_computed = c.start + c.length
        c.request.launch_token(1024)
    assert b.pending_last and b.num_uncomputed == 0
    a.pending -= 1  # a's token landed; a decodes at position 8 and needs a third page
    a.output_ids.append(7)
    plan = s.schedule()
    assert plan.preempted == [b]
    chunks = {c.request.request_id: c for c in plan.chunks}
    assert chunks["a"].samples and chunks["a"].length == 1
    assert chunks["b"].length == 0 and not chunks["b"].samples
    for c in plan.chunks:
        assert c.samples == (c.start + c.length == c.request.num_tokens)


def test_state_slots_gate_admission_and_follow_the_lease():
    """A pool with per-request state (DeepSeek-V4): a request takes a slot when admitted,
    admission waits while none is free, and preemption and finishing give it back."""
    import torch

    from pdserve.kvcache.buffer_spec import StateSpec
    from pdserve.kvcache.state_pool import StatePool

    spec = (StateSpec("ring", (2,), "float32", (0,)),)
    slots = StatePool(spec, torch.zeros(2, 64, dtype=torch.uint8), 4, 1)
    s = Scheduler(
        SchedulerConfig(max_batched_tokens=64, max_running=8),
        Leases(PageAllocator(4), slots),
        4,
    )
    a, b, c = req("a", 7), req("b", 7), req("c", 3)
    for r in (a, b, c):
        s.add(r)
    plan = s.schedule()
    assert [ch.request for ch in plan.chunks] == [a, b]  # c waits: both slots are taken
    assert {a.lease.slot, b.lease.slot} == {0, 1} and slots.num_free == 0
    finish_step(plan)
    plan = s.schedule()
    assert [ch.request for ch in plan.chunks] == [a, b]  # decodes; c still waits
    finish_step(plan)
    plan = s.schedule()  # a needs a third page: b is preempted, its slot goes back
    assert plan.preempted == [b] and b.lease is None and slots.num_free == 1
    assert [ch.request for ch in plan.chunks] == [a]  # b (first in line) waits for pages
    finish_step(plan)
    s.finish(a, Event.LENGTH)
    assert slots.num_free == 2 and s.leases.violations() == []
    plan = s.schedule()
    assert [ch.request for ch in plan.chunks] == [b, c]
    assert {b.lease.slot, c.lease.slot} == {0, 1} and s.leases.violations() == []
