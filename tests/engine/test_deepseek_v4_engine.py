"""DeepSeek-V4 through the engine, co-located: greedy float32 parity with HF `generate` on the
issue's prompt lengths, chunked prefill across every window, batches mixing sequences, and
preemption (a request's state slot recomputed from scratch) — with every page and state slot
back in the pool after each run."""

from __future__ import annotations

import random

import pytest

from pdserve.config import CacheConfig, EngineConfig, ModelSpec, RunnerConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.offline import build_engine, generate
from pdserve.protocol.sampling import SamplingParams
from tests.engine.test_isolation import GREEDY as ISOLATION_GREEDY
from tests.engine.test_isolation import POISONED
from tests.engine.test_isolation import run as run_isolation
from tests.engine.test_overlap import run as run_overlap
from tests.engine.test_parity import prompts_for
from tests.helpers import hf_greedy, make_engine, run

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
LENGTHS = [5, 77, 131, 258, 301, 517]


@pytest.fixture(scope="module")
def v4_dir(builtin_dir):  # type: ignore[no-untyped-def]
    return builtin_dir("deepseek-v4-tiny")


@pytest.fixture(scope="module")
def reference(v4_dir):  # type: ignore[no-untyped-def]
    prompts = prompts_for(2000, LENGTHS, seed=4)
    return prompts, hf_greedy(v4_dir, prompts, NEW_TOKENS)


def empty(engine) -> bool:  # type: ignore[no-untyped-def]
    """Nothing held but what the prefix cache keeps: pages, state slots, leases."""
    state = engine.pool.state
    return (
        engine.pool.allocator.num_held == 0
        and state is not None
        and state.num_free == state.num_slots
        and engine.leases.violations() == []
    )


@pytest.mark.parametrize("chunk", [64, 509])
def test_greedy_matches_hf_alone_and_together(v4_dir, reference, chunk):  # type: ignore[no-untyped-def]
    prompts, ref = reference
    engine = make_engine(v4_dir, chunk=chunk, max_running=8, kv_mb=64, max_model_len=1024)
    assert engine.pool.page_size == 128  # pages of whole 128-token windows
    assert engine.prefix_cache is not None  # the together run below resumes from it
    alone = [run(engine, [p], GREEDY)[0] for p in prompts]
    bad = [(n, a, r) for n, a, r in zip(LENGTHS, alone, ref, strict=True) if a != r]
    assert not bad, f"prompt length, ours, HF: {bad[:2]}"
    assert run(engine, prompts, GREEDY) == ref  # decodes beside prefill chunks
    assert empty(engine)


def test_preemption_recomputes_the_state(v4_dir, reference):  # type: ignore[no-untyped-def]
    prompts, ref = reference
    roomy = make_engine(v4_dir, kv_mb=64)
    assert roomy.pool.state is not None
    page = roomy.pool.layout.page_bytes
    slot = roomy.pool.state.pages_each * page
    # 7 pages for 9 pages' worth of requests, beside their 6 state slots.
    tight = make_engine(v4_dir, chunk=128, max_running=6, kv_mb=(7 * page + 6 * slot) / 2**20)
    assert tight.pool.num_pages == 7
    assert run(tight, prompts[1:5], GREEDY) == ref[1:5]
    assert tight.metrics.preemptions._value.get() > 0
    assert empty(tight)


def test_two_slots_serve_six_requests_in_turn(v4_dir, reference):  # type: ignore[no-untyped-def]
    prompts, ref = reference
    engine = make_engine(v4_dir, chunk=256, max_running=2, kv_mb=64)
    assert engine.pool.state is not None and engine.pool.state.num_slots == 2
    assert run(engine, prompts, GREEDY) == ref
    assert empty(engine)


def tight_engine(v4_dir, pages: int, overlap: bool | None = None):  # type: ignore[no-untyped-def]
    roomy = make_engine(v4_dir, kv_mb=64)
    assert roomy.pool.state is not None
    page = roomy.pool.layout.page_bytes
    slot = roomy.pool.state.pages_each * page
    budget = (pages * page + 6 * slot) / 2**20
    return make_engine(v4_dir, chunk=256, max_running=6, kv_mb=budget, overlap=overlap)


@pytest.mark.parametrize("seed", range(3))
def test_overlap_preempting_a_request_with_its_token_in_flight(v4_dir, seed):  # type: ignore[no-untyped-def]
    """Overlapped scheduling on a pool too small: a request preempted while its last token is
    in flight comes back with a chunk of no tokens, which takes no part in the step."""
    rng = random.Random(seed)
    jobs = [
        (
            [rng.randint(3, 3000) for _ in range(rng.randint(122, 127))],
            SamplingParams(max_tokens=rng.randint(2, 9), temperature=0, ignore_eos=True),
        )
        for _ in range(10)
    ]
    overlapped = tight_engine(v4_dir, 4, overlap=True)
    got = run_overlap(overlapped, jobs, stagger=0)
    assert overlapped.metrics.preemptions._value.get() > 0
    plain = make_engine(v4_dir, chunk=256, max_running=6, kv_mb=64, overlap=False)
    want = run_overlap(plain, jobs, stagger=0)
    assert got == want
    assert empty(overlapped)


def test_a_failed_step_puts_the_state_back_for_the_rerun(v4_dir, monkeypatch):  # type: ignore[no-untyped-def]
    """A step that raises after its layers wrote the state (here: scoring) is rerun a chunk at
    a time; the others' state must read as before the failed attempt, or their tokens drift."""
    clean = run_isolation(make_engine(v4_dir, chunk=512, kv_mb=64), ISOLATION_GREEDY)
    engine = make_engine(v4_dir, chunk=512, kv_mb=64)
    real = engine.runner._score_prompts
    poisoned = f"r{POISONED}"
    failed = []

    def score(chunks, bases, hidden):  # type: ignore[no-untyped-def]
        # Fail the batch when the poisoned request's decode closes a CSA window (its state
        # rewritten most: tail, overlap and ring), every time it runs with others.
        mine = [c for c in chunks if c.request.request_id == poisoned]
        if len(chunks) > 1 and mine and (mine[0].start + 1) % 4 == 0 and mine[0].start > 8:
            failed.append(len(chunks))
            raise RuntimeError("a chunk the model cannot finish")
        return real(chunks, bases, hidden)

    monkeypatch.setattr(engine.runner, "_score_prompts", score)
    dirty = run_isolation(engine, ISOLATION_GREEDY)
    assert failed, "the poisoned step never ran with others"
    assert dirty.pop(poisoned)[1].finish_reason != "error"  # alone it is fine: it goes on
    clean.pop(poisoned)
    assert {k: v[0] for k, v in dirty.items()} == {k: v[0] for k, v in clean.items()}
    assert empty(engine)


def cache_engine(v4_dir, pages: int = 64, host_pages: int = 0, cache: bool = True):  # type: ignore[no-untyped-def]
    page = make_engine(v4_dir, kv_mb=64).pool.layout.page_bytes
    slots = make_engine(v4_dir, kv_mb=64, max_running=4).pool
    assert slots.state is not None
    slot = slots.state.pages_each * page
    cfg = EngineConfig(
        ModelSpec(str(v4_dir), "v4", dtype="float32", device="cpu"),
        CacheConfig(16, pages * page + 4 * slot, cache, host_pages * page),
        SchedulerConfig(max_batched_tokens=96, max_running=4, max_model_len=1024),
        RunnerConfig(),
    )
    return Engine.build(cfg, frozenset())


def test_a_repeated_conversation_resumes_from_the_cache(v4_dir):  # type: ignore[no-untyped-def]
    """The second turn of a conversation starts from the first's cached pages: its state slot
    is rebuilt from the state the last cached page kept of its end (ring, CSA overlap), and
    its tokens are those of an engine without a cache."""
    (first,) = prompts_for(2000, [300], seed=8)
    cached, plain = cache_engine(v4_dir), cache_engine(v4_dir, cache=False)
    reply = run(cached, [first], GREEDY)[0]
    (more,) = prompts_for(2000, [45], seed=9)
    second = first + reply + more  # 361 tokens: 2 cached pages, then 105 computed
    assert run(cached, [second], GREEDY) == run(plain, [second], GREEDY)
    assert cached.prefix_cache is not None
    assert cached.prefix_cache.stats.hit_tokens == 256
    assert empty(cached)


def test_a_conversation_resumes_after_the_host_tier(v4_dir):  # type: ignore[no-untyped-def]
    """A device pool of 5 pages: the first conversation's pages leave for the host tier while
    others run, and come back for its second turn with every component as it was."""
    (first,) = prompts_for(2000, [300], seed=10)
    others = prompts_for(2000, [260, 270], seed=11)
    engine, plain = cache_engine(v4_dir, pages=5, host_pages=16), cache_engine(v4_dir, cache=False)
    reply = run(engine, [first], GREEDY)[0]
    for p in others:  # evicts the first's pages to the host
        run(engine, [p], GREEDY)
    second = first + reply + prompts_for(2000, [30], seed=12)[0]
    assert run(engine, [second], GREEDY) == run(plain, [second], GREEDY)
    assert engine.prefix_cache is not None
    stats = engine.prefix_cache.stats
    assert stats.host_written_pages > 0 and stats.host_loaded_pages >= 2
    assert empty(engine)


def test_without_a_prefix_cache_pages_keep_no_ends(v4_dir, reference):  # type: ignore[no-untyped-def]
    """The page ends serve only a resume from the cache: an engine without one does not pay
    for them, and decodes the same tokens."""
    prompts, ref = reference
    with_ends = build_engine(v4_dir, max_batched_tokens=96, kv_budget_mb=64, max_running=8)
    plain = build_engine(
        v4_dir, max_batched_tokens=96, kv_budget_mb=64, max_running=8, prefix_cache=False
    )
    names = {b.name for b in plain.pool.layout.buffers}
    assert "swa.page_ring" not in names and "swa.page_ring" in {
        b.name for b in with_ends.pool.layout.buffers
    }
    assert plain.pool.layout.page_bytes < with_ends.pool.layout.page_bytes
    assert generate(plain, prompts[:4], GREEDY) == ref[:4]
