from pdserve.config import SchedulerConfig
from pdserve.engine.params import SamplingParams
from pdserve.engine.request import Event, Request, Status
from pdserve.engine.scheduler import Scheduler
from pdserve.kvcache.allocator import PageAllocator


def req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=100), sink=lambda o: None)


def finish_step(plan) -> None:
    """What the engine does after a forward: mark computed, append a token where sampled."""
    for c in plan.chunks:
        c.request.num_computed = c.start + c.length
        if c.samples:
            c.request.output_ids.append(7)


def test_chunked_prefill_respects_budget_then_decodes():
    s = Scheduler(SchedulerConfig(max_batched_tokens=8, max_running=4), PageAllocator(32), 4)
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


def test_decodes_come_first_and_budget_shared():
    s = Scheduler(SchedulerConfig(max_batched_tokens=6, max_running=4), PageAllocator(32), 4)
    a, b = req("a", 3), req("b", 10)
    s.add(a)
    finish_step(s.schedule())  # a prefilled, now decoding
    s.add(b)
    plan = s.schedule()
    assert [(c.request.request_id, c.length) for c in plan.chunks] == [("a", 1), ("b", 5)]


def full_pool_of_two():
    alloc = PageAllocator(4)
    s = Scheduler(SchedulerConfig(max_batched_tokens=64, max_running=4), alloc, 4)
    a, b = req("a", 7), req("b", 7)
    s.add(a)
    s.add(b)
    finish_step(s.schedule())  # both prefilled: 2 pages each, pool full
    finish_step(s.schedule())  # token 9 fits page 2 for both; both need a third next
    return s, alloc, a, b


def test_preemption_by_recompute_frees_pages_and_requeues_first():
    s, alloc, a, b = full_pool_of_two()
    assert alloc.num_free == 0
    plan = s.schedule()  # a needs a third page: b (latest) is preempted
    assert [c.request.request_id for c in plan.chunks] == ["a"]
    assert plan.preempted == [b] and b.status is Status.WAITING and b.num_computed == 0
    assert s.waiting[0] is b and b.pages == [] and b.output_ids == [7, 7]
    assert alloc.num_used == 3


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


def test_finish_releases_pages_once():
    alloc = PageAllocator(8)
    s = Scheduler(SchedulerConfig(), alloc, 4)
    a = req("a", 5)
    s.add(a)
    finish_step(s.schedule())
    s.finish(a, Event.ABORT)
    assert alloc.num_free == 8 and a.status is Status.FINISHED_ABORTED and not s.has_work()


def test_max_running_caps_admission():
    s = Scheduler(SchedulerConfig(max_batched_tokens=100, max_running=2), PageAllocator(64), 4)
    for i in range(3):
        s.add(req(f"r{i}", 3))
    plan = s.schedule()
    assert len(plan.chunks) == 2 and len(s.waiting) == 1
