"""Data-parallel attention's bookkeeping, without ranks (`--dp N`, engine/dp_step.py): the pool
in N parts, one per rank; a request's pages all in one part, chosen by load or by its cached
prefix; preemption and eviction within the part that needs pages; and where each chunk's rows
land once every rank's hidden states are gathered."""

from __future__ import annotations

import pytest

from pdserve.config import SchedulerConfig
from pdserve.engine import dp_step
from pdserve.engine.request import Event, Request
from pdserve.engine.scheduler import Chunk, Scheduler
from pdserve.kvcache.allocator import PageAllocator
from pdserve.kvcache.lease import LeaseError, Leases
from pdserve.kvcache.prefix_cache import PrefixCache
from pdserve.parallel.step_record import SeqPlan
from pdserve.protocol.sampling import SamplingParams

PAGE = 4


def req(rid: str, tokens: list[int], max_tokens: int = 100) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), sink=lambda o: None)


def sched(pages: int, parts: int, cache: bool = False, **cfg: int) -> Scheduler:
    leases = Leases(PageAllocator(pages, parts=parts))
    pc = PrefixCache(leases, PAGE) if cache else None
    return Scheduler(SchedulerConfig(**cfg), leases, PAGE, pc)


def finish_step(plan) -> None:  # type: ignore[no-untyped-def]
    for c in plan.chunks:
        c.request.num_computed = c.start + c.length
        if c.samples:
            c.request.output_ids.append(7)


def part(r: Request) -> int:
    assert r.lease is not None and r.lease.part is not None
    return r.lease.part


def test_requests_spread_over_the_parts_and_keep_their_pages_in_one():
    s = sched(16, parts=2, max_batched_tokens=256, max_running=8)
    reqs = [req(f"r{i}", list(range(1, 6 + i))) for i in range(4)]
    for r in reqs:
        s.add(r)
    for _ in range(6):
        finish_step(s.schedule())
    assert [part(r) for r in reqs] == [0, 1, 0, 1]  # the least loaded part, in turn
    for r in reqs:
        assert {p // 8 for p in r.pages} == {part(r)}, r.pages
    assert s.leases.violations() == []


def test_a_full_part_preempts_in_that_part_only():
    s = sched(8, parts=2, max_batched_tokens=256, max_running=8)
    a, b = req("a", list(range(1, 8))), req("b", list(range(1, 8)))
    c, d = req("c", [1, 2, 3]), req("d", [1, 2])
    for r in (a, b, c, d):
        s.add(r)
    finish_step(s.schedule())  # part 0: a (2 pages), c (1); part 1: b (2), d (1)
    assert [part(r) for r in (a, b, c, d)] == [0, 1, 0, 1]
    finish_step(s.schedule())
    plan = s.schedule()  # a and b take their parts' last pages; c needs one in part 0
    assert [r.request_id for r in plan.preempted] == ["c"]  # not d, the last: of part 1
    assert d in s.running and len(a.pages) == len(b.pages) == 3
    assert s.leases.violations() == []


def test_a_cached_prefix_brings_a_request_to_the_part_that_holds_it():
    s = sched(16, parts=2, cache=True, max_batched_tokens=256, max_running=8)
    prompt = list(range(1, 14))  # 3 full pages
    first, other = req("first", prompt, max_tokens=1), req("other", [50, 51, 52])
    s.add(other)
    s.add(first)
    finish_step(s.schedule())
    assert (part(other), part(first)) == (0, 1)
    s.finish(first, Event.LENGTH)
    again = req("again", [*prompt, 99])
    s.add(again)
    plan = s.schedule()  # part 0 runs fewer requests now, but part 1 holds its prefix
    assert part(again) == 1 and again.num_computed == 12
    assert [(c.request.request_id, c.start) for c in plan.chunks if c.request is again] == [
        ("again", 12)
    ]
    assert s.leases.violations() == []


def test_a_full_part_sends_new_requests_to_one_with_room():
    s = sched(8, parts=2, cache=True, max_batched_tokens=256, max_running=8)
    prompt = list(range(1, 14))  # 3 full pages and a 4th: all of part 0
    big, one, two = req("big", prompt), req("one", [60, 61]), req("two", [62, 63])
    for r in (big, one, two):
        s.add(r)
    finish_step(s.schedule())
    assert [part(r) for r in (big, one, two)] == [0, 1, 1]
    # Part 0 runs fewer requests but has no page left: the next goes to part 1.
    assert s.allocator.available(0) == 0
    nxt = req("next", [70, 71, 72])
    s.add(nxt)
    finish_step(s.schedule())
    assert part(nxt) == 1 and nxt in s.running
    # A prefix cached only in part 0, which is full, is computed again in part 1.
    for r in (nxt, one, two, big):
        s.finish(r, Event.LENGTH)  # big's 3 full pages stay cached in part 0...
    s.leases.open("room", 1, part=0)  # ...and a room takes part 0's last free page
    again = req("again", [*prompt, 99])  # its hit would leave it a page short in part 0
    s.add(again)
    s.schedule()
    assert part(again) == 1 and again.num_computed == 0 and again in s.running


def test_a_lease_refuses_another_parts_page():
    leases = Leases(PageAllocator(8, parts=2))
    mine = leases.open("a", 1, part=1)
    assert mine.pages == [4]
    theirs = leases.open("b", 1, part=0)
    with pytest.raises(LeaseError, match="in part 1 cannot share page 0 of part 0"):
        leases.open("c", part=1).share(theirs.pages)
    with pytest.raises(LeaseError, match="fresh pages are taken in a part"):
        leases.open("d", 1, part=None)
    assert mine.extend(1) == [5]


def test_the_cache_keeps_one_prefix_per_part_and_evicts_the_part_short_of_pages():
    leases = Leases(PageAllocator(8, parts=2))
    cache = PrefixCache(leases, PAGE)
    tokens = list(range(1, 9))  # 2 full pages
    for p in (0, 1):
        lease = leases.open(f"r{p}", 2, part=p)
        assert cache.insert(tokens, lease.pages, 8) == 2  # the same prefix, once per part
        lease.release()
    assert cache.match(tokens, 0) == [0, 1] and cache.match(tokens, 1) == [4, 5]
    leases.open("big", 4, part=1)  # part 1 has 2 free pages: its cached 2 are evicted
    assert cache.match(tokens, 1) == [] and cache.match(tokens, 0) == [0, 1]
    assert leases.violations() == [] and cache.violations() == []


def chunk(rid: str, rank: int, start: int, length: int, pages: list[int]) -> Chunk:
    leases = Leases(PageAllocator(16, parts=2))
    r = req(rid, list(range(1, start + length + 1)))
    r.lease = leases.open(rid, part=rank)
    r.num_computed = start
    return Chunk(r, start, length)


def test_each_chunk_lands_in_its_ranks_rows_of_the_gathered_states():
    chunks = [
        chunk("d0", 1, 5, 1, []),  # decodes first
        chunk("d1", 0, 7, 1, []),
        chunk("d2", 1, 3, 1, []),
        chunk("p0", 0, 0, 4, []),
        chunk("p1", 1, 8, 3, []),
    ]
    split = dp_step.split(chunks, 2)
    assert split.ranks == [1, 0, 1, 0, 1]
    assert split.counts == [5, 5]
    # Rank 0's rows first (d1, p0), then rank 1's (d0, d2, p1), each in the step's order.
    assert split.bases == [5, 0, 6, 1, 7]
    assert [c.request.request_id for c in split.of(chunks, 1)] == ["d0", "d2", "p1"]
    assert dp_step.sample_rows(chunks, split.bases) == [5, 0, 6, 4, 9]


def test_the_plan_numbers_pages_as_each_ranks_pool_does():
    plan = [SeqPlan([1], 4, [8, 9], True), SeqPlan([2], 0, [1], True)]
    local = dp_step.local_pages(plan, [1, 0], part_pages=8)
    assert [(list(s.pages), s.rank) for s in local] == [([0, 1], 1), ([1], 0)]
    assert dp_step.rank_counts(local, 2) == [1, 1]
    with pytest.raises(ValueError, match="a sequence of rank 1 in a group of 1"):
        dp_step.rank_counts(local, 1)
    with pytest.raises(RuntimeError, match=r"pages \[7, 8\] are not all in rank 1's pool"):
        dp_step.local_pages([SeqPlan([1], 0, [7, 8], True)], [1], part_pages=8)


def test_dp_is_refused_where_it_cannot_run(tiny_dir, tmp_path, capsys):  # type: ignore[no-untyped-def]
    from pdserve.cli import main
    from pdserve.config import EngineConfig, ModelSpec, ServerConfig
    from pdserve.engine.offline import build_engine

    refusals = {
        ("serve", "--dp", "2"): "add --ep",
        ("serve", "--ep"): "--ep goes with --dp N",
        ("serve", "--dp", "2", "--ep", "--tp", "4"): "--dp 2 with --tp 4",
        ("launch", "--prefill", "1", "--dp", "2", "--ep", "--decode-tp", "1"): "must be 2 or unset",
    }
    for argv, why in refusals.items():
        assert main([*argv, "--model", str(tiny_dir)]) == 2, argv
        assert why in capsys.readouterr().err, argv
    spec = ModelSpec(str(tiny_dir), "tiny")
    cuda = ModelSpec(str(tiny_dir), "tiny", device="cuda")
    with pytest.raises(ValueError, match="a decode worker at --tp 2 runs on the CPU"):
        ServerConfig(EngineConfig(cuda, tp=2, dp_attention=True), role="decode")
    with pytest.raises(ValueError, match="needs 2 or more ranks"):
        EngineConfig(spec, dp_attention=True)
    with pytest.raises(ValueError, match="llama has no data-parallel attention"):
        build_engine(tiny_dir, tp=2, dp_attention=True)  # before any rank starts
