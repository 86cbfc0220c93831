"""The prefix cache in the scheduler and the engine: admission shares the cached prefix and
computes only the rest, leaving requests caches their pages, and outputs do not change."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.config import SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.offline import build_engine, generate
from pdserve.engine.request import Event, Request, Status
from pdserve.engine.scheduler import Scheduler
from pdserve.kvcache.allocator import PageAllocator
from pdserve.kvcache.lease import Lease, Leases
from pdserve.kvcache.prefix_cache import PrefixCache
from pdserve.protocol.sampling import SamplingParams

PS = 4
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def req(rid: str, prompt: list[int], **params: object) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=100, **params), sink=lambda o: None)  # type: ignore[arg-type]


def sched(num_pages: int, **cfg: int) -> Scheduler:
    leases = Leases(PageAllocator(num_pages))
    return Scheduler(SchedulerConfig(**cfg), leases, PS, PrefixCache(leases, PS))


def run_to_decode(s: Scheduler, r: Request) -> None:
    """Schedule until `r` has computed its prompt and sampled one token."""
    while not r.output_ids:
        for c in s.schedule().chunks:
            c.request.num_computed = c.start + c.length
            if c.samples:
                c.request.output_ids.append(7)


def ok(s: Scheduler) -> None:
    assert s.cache is not None
    assert s.leases.violations() == [] and s.cache.violations() == []


def test_admission_shares_the_cached_prefix_and_computes_the_rest():
    s = sched(32, max_batched_tokens=64)
    a = req("a", list(range(1, 15)))  # 3 full pages and 2 tokens
    s.add(a)
    run_to_decode(s, a)
    a_pages = a.pages
    s.finish(a, Event.STOP)  # 14 computed: 3 full pages cached
    assert s.cache is not None and len(s.cache) == 3
    b = req("b", list(range(1, 13)) + [99, 98, 97])  # the same first 3 pages
    s.add(b)
    plan = s.schedule()
    assert [(c.request, c.start, c.length) for c in plan.chunks] == [(b, 12, 3)]
    assert b.pages[:3] == a_pages[:3] and b.num_pages == 4
    ok(s)


def test_a_page_aligned_repeat_still_computes_its_last_token():
    s = sched(32, max_batched_tokens=64)
    a = req("a", list(range(1, 13)))  # exactly 3 pages
    s.add(a)
    run_to_decode(s, a)
    s.finish(a, Event.LENGTH)
    b = req("b", list(range(1, 13)))
    s.add(b)
    (chunk,) = s.schedule().chunks
    assert (chunk.start, chunk.length, chunk.samples) == (8, 4, True)  # 2 pages hit, not 3
    ok(s)


def test_nothing_is_cached_from_a_failed_request_or_for_one_scoring_its_prompt():
    s = sched(32, max_batched_tokens=64)
    a = req("a", list(range(1, 13)))
    s.add(a)
    run_to_decode(s, a)
    s.finish(a, Event.FAIL)
    assert s.cache is not None and len(s.cache) == 0
    b = req("b", list(range(1, 13)))
    s.add(b)
    run_to_decode(s, b)
    s.finish(b, Event.STOP)
    c = req("c", list(range(1, 13)), prompt_logprobs=0)  # needs every position's logits
    s.add(c)
    (chunk,) = s.schedule().chunks
    assert chunk.start == 0
    ok(s)


def test_a_request_that_waits_for_pages_holds_none():
    s = sched(6, max_batched_tokens=64)
    a = req("a", list(range(1, 13)))
    s.add(a)
    run_to_decode(s, a)
    s.finish(a, Event.STOP)  # 3 pages cached
    hog = req("hog", list(range(100, 112)))
    s.add(hog)
    s.schedule()  # takes the 3 free pages and keeps them
    b = req("b", list(range(1, 9)) + list(range(50, 66)))  # 2 pages hit, 5 more needed
    s.add(b)
    plan = s.schedule()
    assert b not in [c.request for c in plan.chunks] and b.lease is None and b.num_computed == 0
    assert s.cache is not None and s.cache.match(b.prompt_ids) != []  # still cached
    assert s.cache.stats.queries == 2  # a and hog: b's lookups count once it is admitted
    ok(s)


def test_preemption_caches_what_was_computed_and_the_victim_resumes_from_it():
    s = sched(8, max_batched_tokens=64)
    a, b = req("a", list(range(1, 14))), req("b", list(range(101, 114)))
    s.add(a)
    s.add(b)
    run_to_decode(s, a)  # both prefilled: 4 pages each, the pool is full
    assert s.allocator.num_free == 0
    for _ in range(8):  # a decodes until it needs b's pages
        if b.num_preemptions:
            break
        for c in s.schedule().chunks:
            c.request.num_computed = c.start + c.length
            c.request.output_ids.append(7)
        ok(s)
    assert b.num_preemptions == 1 and b.lease is None and s.cache is not None
    assert s.cache.stats.inserted_pages == 4  # b's computed pages were cached when it left
    s.finish(a, Event.STOP)
    (chunk,) = s.schedule().chunks
    assert chunk.request is b and chunk.start >= PS  # it did not start again from 0
    ok(s)


def test_random_workloads_with_the_cache_keep_counts_exact_and_never_write_a_shared_page():
    """Admit prompts sharing prefixes, preempt, finish (STOP, ABORT, FAIL) and hand over in a
    seeded random order: after every step each page's count is its leases', and every page a
    chunk writes is its request's alone (a cached or shared page is never written)."""
    rng = random.Random(5)
    s = sched(16, max_batched_tokens=16, max_running=6)
    assert s.cache is not None
    prefixes = [[rng.randrange(1, 30) for _ in range(16)] for _ in range(3)]
    kept: list[Lease] = []
    preempted = 0
    for step in range(2000):
        op = rng.random()
        live = s.running + list(s.waiting)
        if op < 0.12:
            prompt = rng.choice(prefixes)[: rng.randint(1, 16)]
            prompt += [rng.randrange(1, 30) for _ in range(rng.randint(0, 6))]
            s.add(
                Request(
                    f"r{step}",
                    prompt,
                    SamplingParams(max_tokens=rng.randint(1, 20)),
                    sink=lambda o: None,
                )
            )
        elif op < 0.17 and live:
            s.finish(rng.choice(live), rng.choice([Event.ABORT, Event.FAIL]))
        elif op < 0.2 and live:
            r = rng.choice(live)
            lease = s.hand_over(
                r, Event.STOP if r.status is Status.RUNNING else Event.ABORT, f"room {step}"
            )
            if lease is not None:
                kept.append(lease)
        elif op < 0.24 and kept:
            kept.pop(rng.randrange(len(kept))).release()
        else:
            plan = s.schedule()
            preempted += len(plan.preempted)
            for c in plan.chunks:
                pages = c.request.pages
                for i in range(c.start // PS, (c.start + c.length - 1) // PS + 1):
                    assert s.allocator.refcount(pages[i]) == 1, step
            for c in plan.chunks:
                c.request.num_computed = c.start + c.length
                if c.samples:
                    c.request.output_ids.append(rng.randrange(1, 30))
            for r in list(s.running):
                if len(r.output_ids) >= r.params.max_tokens:
                    s.finish(r, Event.LENGTH)
        assert all(r.lease is None and r.num_computed == 0 for r in s.waiting), step
        ok(s)
    assert preempted > 10 and s.cache.stats.hit_tokens > 0 and s.cache.stats.evicted_pages > 0
    for r in s.running + list(s.waiting):
        s.finish(r, Event.ABORT)
    for lease in kept:
        lease.release()
    assert s.allocator.num_used == s.allocator.num_evictable == len(s.cache)
    s.cache.clear()
    assert s.allocator.num_free == 16 and len(s.leases) == 1  # the cache's own, now empty
    ok(s)


# -- the engine, tiny model ---------------------------------------------------------------
def chunks_of(engine: Engine) -> list[tuple[str, int, int]]:
    """Every chunk the runner computes, as (request id, start, length)."""
    seen: list[tuple[str, int, int]] = []
    forward = engine.runner.forward

    def recording(chunks, feed=None):  # type: ignore[no-untyped-def]
        seen.extend((c.request.request_id, c.start, c.length) for c in chunks)
        return forward(chunks, feed)

    engine.runner.forward = recording  # type: ignore[method-assign]
    return seen


def engine(tiny_dir, cache: bool, **kw: object) -> Engine:
    args = {"page_size": PS, "max_batched_tokens": 16, "kv_budget_mb": 4.0} | kw
    return build_engine(tiny_dir, prefix_cache=cache, **args)  # type: ignore[arg-type]


def test_a_shared_prefix_is_computed_once_and_outputs_do_not_change(tiny_dir):
    base = [(i * 7) % 200 + 3 for i in range(37)]
    prompts = [base, base[:32] + [5, 6, 7, 8, 9], base]
    on, off = engine(tiny_dir, True), engine(tiny_dir, False)
    seen = chunks_of(on)
    got = [generate(on, [p], GREEDY)[0] for p in prompts]
    assert got == [generate(off, [p], GREEDY)[0] for p in prompts]
    first = {}
    for rid, start, _length in seen:
        first.setdefault(rid, start)
    # The first prompt from 0; the second from its 8 shared pages; the repeat from the last
    # full page before its final token (its first 48 tokens, output included, are cached).
    assert list(first.values()) == [0, 32, 36]
    assert on.prefix_cache is not None and on.prefix_cache.stats.hit_tokens == 32 + 36
    assert on.leases.violations() == [] and on.prefix_cache.violations() == []
    assert on.pool.allocator.num_used == on.pool.allocator.num_evictable  # only the cache's
    state = on._snapshot()
    assert state["prefix_cache"]["hits"] == 2 and state["pool"]["leases"] == 0
    assert state["pool"]["pages_cached"] == len(on.prefix_cache)
    on.step()  # the metrics follow the stats
    assert b"pdserve_prefix_cache_hit_tokens_total 68.0" in on.metrics.render()


def test_greedy_matches_hf_with_shared_prefixes_eviction_and_preemption(tiny_dir):
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(3)
    system = torch.randint(3, 2000, (24,), generator=g).tolist()
    tails = (5, 9, 13, 20)
    prompts = [system + torch.randint(3, 2000, (n,), generator=g).tolist() for n in tails]
    prompts += [prompts[0], system[:16] + [11, 12, 13], prompts[1]]
    pool_pages = 24  # 96 tokens: 4 running requests of up to 44 + 12 tokens do not fit
    bpp = engine(tiny_dir, False).pool.layout.bytes_per_page_all_layers
    tight = engine(tiny_dir, True, kv_budget_mb=bpp * pool_pages / 2**20, max_running=4)
    got = generate(tight, prompts, GREEDY)  # the first wave misses; the repeats hit
    got += generate(tight, prompts, GREEDY)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    ref = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)
            ref.append(ids[0, len(p) :].tolist())
    assert got == ref + ref
    stats = tight.prefix_cache.stats if tight.prefix_cache is not None else None
    assert stats is not None and stats.hits > 0 and stats.evicted_pages > 0
    assert tight.metrics.preemptions._value.get() > 0
    assert tight.leases.violations() == [] and tight.prefix_cache.violations() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cache_hits_give_the_same_greedy_ids_on_the_gpu_with_graphs(tiny_dir):
    """The triton backend and CUDA-graph decode on shared, cached pages: the ids of the same
    engine with the cache off."""
    g = torch.Generator().manual_seed(4)
    system = torch.randint(3, 2000, (40,), generator=g).tolist()
    prompts = [system + torch.randint(3, 2000, (n,), generator=g).tolist() for n in (1, 7, 30)]
    prompts += [prompts[0], system[:33]]

    def ids(cache: bool) -> list[list[int]]:
        eng = build_engine(
            tiny_dir,
            device="cuda",
            page_size=16,
            max_batched_tokens=32,
            attention_backend="triton",
            cuda_graph_max_bs=16,
            prefix_cache=cache,
        )
        out = [generate(eng, [p], GREEDY)[0] for p in prompts]
        if cache:
            assert eng.prefix_cache is not None and eng.prefix_cache.stats.hits >= 3
            assert eng.runner.graphs is not None and eng.runner.graphs.replays > 0
        return out

    assert ids(True) == ids(False)
