"""DeepSeek-V4 through the engine, co-located: greedy float32 parity with HF `generate` on the
issue's prompt lengths, chunked prefill across every window, batches mixing sequences, and
preemption (a request's state slot recomputed from scratch) — with every page and state slot
back in the pool after each run."""

from __future__ import annotations

import random

import pytest

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
    assert engine.prefix_cache is None  # it keeps no per-request state yet
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

    def score(chunks, batch, hidden):  # type: ignore[no-untyped-def]
        # Fail the batch when the poisoned request's decode closes a CSA window (its state
        # rewritten most: tail, overlap and ring), every time it runs with others.
        mine = [c for c in chunks if c.request.request_id == poisoned]
        if len(chunks) > 1 and mine and (mine[0].start + 1) % 4 == 0 and mine[0].start > 8:
            failed.append(len(chunks))
            raise RuntimeError("a chunk the model cannot finish")
        return real(chunks, batch, hidden)

    monkeypatch.setattr(engine.runner, "_score_prompts", score)
    dirty = run_isolation(engine, ISOLATION_GREEDY)
    assert failed, "the poisoned step never ran with others"
    assert dirty.pop(poisoned)[1].finish_reason != "error"  # alone it is fine: it goes on
    clean.pop(poisoned)
    assert {k: v[0] for k, v in dirty.items()} == {k: v[0] for k, v in clean.items()}
    assert empty(engine)
