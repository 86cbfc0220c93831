"""Overlapped scheduling (engine/inflight.py, issue 13 part 5) gives exactly the tokens of the
plain loop, emits nothing past a stop, and frees an ended request's pages only after the step
that computes it. The CPU runs the overlapped loop too (`overlap=True`): the device work is
synchronous there, but every path (pending inputs filled from the previous step's ids, outputs
processed one step later, retired leases) is the one CUDA runs."""

from __future__ import annotations

import pytest

from pdserve.engine.request import RequestOutput
from pdserve.protocol.sampling import SamplingParams
from tests.helpers import make_engine
from tests.worker.wire import Wire

PROMPTS = [[(11 * i + 3 * j) % 250 + 3 for j in range(3 + 5 * i)] for i in range(10)]


def run(eng, jobs, stagger: int = 0, abort: dict[str, int] | None = None):
    """Submit `jobs` [(prompt, params)], the i-th after i * `stagger` ticks; abort a request
    after the given tick. Returns each request's tokens and last output."""
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(jobs))}
    ends: dict[str, RequestOutput] = {}

    def sink_for(rid: str):
        def sink(o: RequestOutput) -> None:
            assert rid not in ends, f"{rid} heard after its end"
            outs[rid].extend(o.token_ids)
            if o.finish_reason is not None:
                ends[rid] = o

        return sink

    for tick in range(5000):
        for i, (prompt, params) in enumerate(jobs):
            if i * stagger == tick:
                eng.submit(f"r{i}", prompt, params, sink_for(f"r{i}"))
        for rid, at in (abort or {}).items():
            if at == tick:
                eng.abort(rid)
        if len(ends) == len(jobs):
            break
        eng.tick()
    assert len(ends) == len(jobs), f"{len(jobs) - len(ends)} requests did not end"
    for _ in range(3):  # a step still in flight (one past a stop) completes
        if eng.has_work():
            eng.tick()
    assert not eng.has_work() and eng.pool.allocator.num_held == 0  # nothing leaked
    assert eng.leases.violations() == []
    return {rid: (outs[rid], ends[rid].finish_reason) for rid in outs}


MIXED = [
    SamplingParams(max_tokens=1 + 3 * (i % 5), temperature=0, ignore_eos=True) for i in range(10)
]


def assorted(tiny_dir) -> list[SamplingParams]:
    """One batch of every kind: greedy of mixed lengths, seeded draws, stop ids that the
    greedy run really samples (so requests end on a token the overlapped loop has already
    scheduled past), min_tokens, penalties (counted on the device, a token in flight included)
    and logprobs."""
    probe = run(make_engine(tiny_dir, overlap=False), [(p, MIXED[4]) for p in PROMPTS[4:7]])
    stop = [probe[f"r{j}"][0][1 + j] for j in range(3)]  # of requests 4, 5 and 6
    return [
        MIXED[1],
        MIXED[3],
        SamplingParams(max_tokens=9, temperature=0.9, top_k=20, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=1.0, top_p=0.8, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=13, temperature=0, stop_token_ids=(stop[0],)),
        SamplingParams(max_tokens=13, temperature=0, stop_token_ids=(stop[1],), min_tokens=2),
        SamplingParams(max_tokens=13, temperature=0, stop_token_ids=(stop[2],)),
        SamplingParams(
            max_tokens=8, temperature=0.8, seed=3, frequency_penalty=0.5, ignore_eos=True
        ),
        SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True),
    ]


@pytest.mark.parametrize("stagger", [0, 2], ids=["together", "joining"])
def test_overlap_gives_the_tokens_of_the_plain_loop(tiny_dir, stagger):
    jobs = list(zip(PROMPTS, assorted(tiny_dir), strict=True))
    plain = run(make_engine(tiny_dir, overlap=False), jobs, stagger=stagger)
    overlapped = run(make_engine(tiny_dir, overlap=True), jobs, stagger=stagger)
    assert overlapped == plain
    # Requests ended on a sampled stop id (min_tokens may steer one past its stop id).
    assert sum(plain[f"r{i}"][1] == "stop" for i in (4, 5, 6)) >= 2


def test_preemption_with_a_token_in_flight_keeps_the_tokens(tiny_dir):
    """A KV pool too small for every request: running requests are preempted while their
    last token is still on the device, and recompute their prompt plus outputs later."""
    jobs = [(p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)) for p in PROMPTS]
    small = {"kv_mb": 1.0, "page_size": 4}
    plain_eng = make_engine(tiny_dir, overlap=False, **small)
    plain = run(plain_eng, jobs)
    eng = make_engine(tiny_dir, overlap=True, **small)
    assert run(eng, jobs) == plain
    assert eng.metrics.preemptions._value.get() > 0  # noqa: SLF001 - preemption happened


def test_a_known_last_token_schedules_nothing_more(tiny_dir):
    """max_tokens is known in advance: the overlapped loop computes exactly the plain loop's
    chunks, never a wasted step after the last token."""
    seen: dict[bool, list[tuple[str, int, int]]] = {}
    for overlap in (False, True):
        eng = make_engine(tiny_dir, overlap=overlap)
        chunks: list[tuple[str, int, int]] = []
        forward = eng.runner.forward

        def recording(cs, feed=None, forward=forward, chunks=chunks):  # type: ignore[no-untyped-def]
            chunks.extend((c.request.request_id, c.start, c.length) for c in cs)
            return forward(cs, feed)

        eng.runner.forward = recording  # type: ignore[method-assign]
        run(eng, [(p, MIXED[i]) for i, p in enumerate(PROMPTS)])
        seen[overlap] = sorted(chunks)
    assert seen[True] == seen[False]


def test_an_abort_while_its_step_is_in_flight_drops_the_token_and_frees_after(tiny_dir):
    eng = make_engine(tiny_dir, overlap=True)
    outs: list[RequestOutput] = []
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    eng.submit("r", PROMPTS[3], params, outs.append)
    for _ in range(4):
        eng.tick()
    req = eng.scheduler.get("r")
    assert req is not None and req.pending == 1  # a decode step is in flight
    emitted = sum(len(o.token_ids) for o in outs)
    eng.abort("r")
    eng._drain_inbox(0)  # noqa: SLF001 - handle the Abort, not the next step
    assert outs[-1].finish_reason == "abort"
    # Its pages stay leased to the step in flight until that step completed.
    assert eng.pool.allocator.num_held > 0
    assert any(str(le.owner).startswith("step:") for le in eng.leases.live())
    eng.tick()
    assert sum(len(o.token_ids) for o in outs) == emitted  # the in-flight token never shows
    assert not eng.has_work() and eng.pool.allocator.num_held == 0
    assert eng.leases.violations() == []


def test_pd_decode_with_overlap_matches_colocated(tiny_dir):
    """A decode worker overlapping its steps over pages a prefill worker wrote."""
    params = [
        SamplingParams(max_tokens=8, temperature=0.7, seed=i, ignore_eos=True) for i in range(6)
    ]
    jobs = list(zip(PROMPTS[:6], params, strict=True))
    colocated = run(make_engine(tiny_dir, page_size=4, chunk=16, overlap=False), jobs)
    wire = Wire(tiny_dir, overlap=True)
    outs = {f"r{i}": wire.submit(f"r{i}", p, sp) for i, (p, sp) in enumerate(jobs)}
    wire.run_until(lambda: all(o and o[-1].finish_reason for o in outs.values()))
    wire.run_until(wire.idle)
    got = {
        rid: ([t for o in os_ for t in o.token_ids], os_[-1].finish_reason)
        for rid, os_ in outs.items()
    }
    assert got == colocated
    assert wire.violations() == []


def test_pd_decode_with_overlap_under_memory_pressure_matches_colocated(tiny_dir):
    """Seeded random workloads through a prefill and an overlapping decode worker whose pool is
    8-14 pages of 4 tokens (rooms wait for pages, requests preempt on D and recompute there),
    budgets of 3-16 tokens: every request gets the co-located plain loop's tokens and finish,
    nothing leaks, and enough of them preempt on D."""
    import random

    page_bytes = make_engine(tiny_dir, page_size=4).pool.layout.page_bytes
    preempting = 0
    for seed in range(8):
        rng = random.Random(seed)
        pages, chunk = rng.randint(8, 14), rng.choice([3, 5, 8, 16])
        wire = Wire(tiny_dir, overlap=True, chunk=chunk, d_kv_mb=pages * page_bytes / 2**20)
        jobs = []
        for _ in range(rng.randint(3, 7)):
            sp = SamplingParams(
                max_tokens=rng.randint(1, 10),
                temperature=0 if rng.random() < 0.5 else 1.5,
                seed=rng.randint(0, 99),
                ignore_eos=True,
            )
            prompt = [rng.randint(3, 60) for _ in range(rng.randint(1, 12))]
            if len(prompt) + sp.max_tokens <= wire.d.max_model_len:
                jobs.append((prompt, sp))
        colocated = run(make_engine(tiny_dir, page_size=4, chunk=chunk, overlap=False), jobs)
        assert wire.run_jobs(jobs) == colocated, seed
        assert wire.violations() == []
        preempting += wire.d.metrics.preemptions._value.get() > 0
    assert preempting >= 2


def test_feed_fills_a_run_by_a_slice_and_anything_else_by_index():
    import torch

    from pdserve.engine.inflight import Feed

    feed = Feed(torch.tensor([40, 41, 42, 43]), [])
    assert feed.staged_rows([0, 1, 2], [1, 2, 3]) == []  # each a run: a slice copy
    ids = torch.zeros(5, dtype=torch.int32)
    feed.fill(ids, [0, 1, 2], [1, 2, 3], [])
    assert ids.tolist() == [41, 42, 43, 0, 0]
    dst, src = [0, 1, 4], [3, 0, 2]  # a request left or joined: rows by index
    staged = feed.staged_rows(dst, src)
    assert staged == [dst, src]
    ids = torch.zeros(5, dtype=torch.int32)
    feed.fill(ids, dst, src, [torch.tensor(r, dtype=torch.int32) for r in staged])
    assert ids.tolist() == [43, 40, 0, 0, 42]


def test_feed_finds_each_request_row_in_order_or_not_and_names_one_not_in_flight():
    import pytest
    import torch

    from pdserve.engine.inflight import Feed
    from pdserve.engine.request import Request
    from pdserve.protocol.sampling import SamplingParams

    sp = SamplingParams(max_tokens=4)
    a, b, c, d = (Request(f"r{i}", [1, 2], sp, lambda _o: None) for i in range(4))
    feed = Feed(torch.tensor([40, 41, 42]), [a, b, c])
    assert feed.rows([a, b, c]) == [0, 1, 2]  # the step in flight's own order
    assert feed.rows([c, a]) == [2, 0]  # one left, the others in another order
    assert feed.rows([]) == []
    assert feed.rows([b]) == [1]
    with pytest.raises(RuntimeError, match="request r3: no token of it is in flight"):
        feed.rows([a, d, b])
    same_ids = Feed(torch.tensor([40, 41, 42]), [a, b, c])
    twin = Request("r1", [1, 2], sp, lambda _o: None)  # equal id, another request
    with pytest.raises(RuntimeError, match="request r1"):
        same_ids.rows([a, twin, c])


def collect(outs: dict[str, list[int]], rid: str):
    return lambda o: outs[rid].extend(o.token_ids)


def test_page_table_rows_are_given_back_and_reused_exactly(tiny_dir):
    """A request that ends (an abort) gives its persistent page-table row back; the next
    request takes that row, and every request's tokens are the plain loop's."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    jobs = [(PROMPTS[i], params) for i in range(4)]
    got = {}
    for overlap in (False, True):
        eng = make_engine(tiny_dir, overlap=overlap)
        table = eng.runner.builder.table
        outs: dict[str, list[int]] = {}
        for i, (prompt, p) in enumerate(jobs[:3]):
            outs[f"r{i}"] = []
            eng.submit(f"r{i}", prompt, p, collect(outs, f"r{i}"))
        for _ in range(6):
            eng.tick()
        r1 = eng.scheduler.get("r1")
        slot = table.slot_of(r1)
        assert slot is not None and len(table) == 3
        eng.abort("r1")
        eng._drain_inbox(0)  # noqa: SLF001 - handle the Abort, not the next step
        assert table.slot_of(r1) is None and len(table) == 2
        outs["r3"] = []
        eng.submit("r3", jobs[3][0], params, collect(outs, "r3"))
        for _ in range(8):
            eng.tick()
        assert table.slot_of(eng.scheduler.get("r3")) == slot  # the freed row, rewritten
        while eng.has_work():
            eng.tick()
        assert len(table) == 0 and eng.pool.allocator.num_held == 0
        got[overlap] = outs
    for rid in ("r0", "r2", "r3"):
        assert got[True][rid] == got[False][rid] and len(got[True][rid]) == 12
    aborted = got[True]["r1"]  # overlapped, its token in flight at the abort is dropped
    assert aborted == got[False]["r1"][: len(aborted)]


def test_a_request_preempted_with_its_last_token_in_flight_ends_normally(tiny_dir):
    """Overlapped, four pages, three requests: when c needs a page, v (the newest) is preempted
    while the step that samples its last token (max_tokens) is in flight, and the step's budget
    is spent by a and c, so v stays WAITING when that token arrives. It ends with that token
    and finish reason "length", not an error. (A stop id in flight takes the same path: the
    WAITING -> STOP edge, tests/engine/test_request.py.)"""
    import dataclasses

    from pdserve.engine.offline import build_engine

    def scenario(v_params: SamplingParams) -> tuple[dict[str, tuple[str, str | None]], dict]:
        pb = make_engine(tiny_dir, page_size=4, overlap=True).pool.layout.page_bytes
        eng = build_engine(
            tiny_dir,
            page_size=4,
            max_batched_tokens=3,
            max_running=3,
            kv_budget_mb=4 * pb / 2**20 + 1e-9,  # four pages
            max_model_len=1024,
            overlap_schedule=True,
            prefix_cache=False,
        )
        ends: dict[str, tuple[str, str | None]] = {}
        toks: dict[str, list[int]] = {}
        jobs = [("a", [5, 6], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))]
        jobs += [("c", [5], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))]
        jobs += [("v", [5], v_params)]
        for rid, prompt, sp in jobs:
            toks[rid] = []

            def sink(o: RequestOutput, rid: str = rid) -> None:
                toks[rid].extend(o.token_ids)
                if o.finish_reason:
                    ends[rid] = (o.finish_reason, o.error)

            eng.submit(rid, prompt, sp, sink)
        for i in range(60):
            if i == 4:  # the step that preempts v: a's and c's decodes spend the budget
                eng.scheduler.cfg = dataclasses.replace(eng.scheduler.cfg, max_batched_tokens=2)
            if len(ends) == 3 and not eng.has_work():
                break
            eng.tick()
        assert eng.metrics.preemptions._value.get() == 1  # the scenario happened
        return ends, toks

    ends, toks = scenario(SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert ends == {"a": ("length", None), "c": ("length", None), "v": ("length", None)}
    assert [len(toks[r]) for r in "acv"] == [6, 6, 3]


def test_overlap_equals_plain_on_random_workloads_under_memory_pressure(tiny_dir):
    """Seeded random workloads on pools of 6-12 pages of 4 tokens, token budgets of 2-16 and
    up to 7 requests (greedy and seeded draws, stop ids, prefix cache on or off): overlapped
    scheduling gives every request the plain loop's tokens and finish reason, none ends in an
    error, and enough of them preempt to exercise tokens in flight across a preemption."""
    import random

    from pdserve.engine.offline import build_engine

    page_bytes = make_engine(tiny_dir, page_size=4).pool.layout.page_bytes

    def run(seed: int, overlap: bool) -> tuple[dict, dict, float]:
        rng = random.Random(seed)
        pages = rng.randint(6, 12)
        eng = build_engine(
            tiny_dir,
            page_size=4,
            max_batched_tokens=rng.choice([2, 3, 5, 8, 16]),
            max_running=rng.randint(2, 6),
            kv_budget_mb=pages * page_bytes / 2**20 + 1e-9,
            max_model_len=1024,
            overlap_schedule=overlap,
            prefix_cache=rng.random() < 0.5,
        )
        toks: dict[int, list[int]] = {}
        ends: dict[int, tuple[str | None, str | None]] = {}
        for i in range(rng.randint(3, 7)):
            greedy = rng.random() < 0.5
            sp = SamplingParams(
                max_tokens=rng.randint(1, 10),
                temperature=0 if greedy else 1.5,
                seed=rng.randint(0, 99),
                ignore_eos=True,
                stop_token_ids=tuple(rng.sample(range(3, 4000), 30)) if rng.random() < 0.5 else (),
            )
            prompt = [rng.randint(3, 60) for _ in range(rng.randint(1, 12))]
            if len(prompt) + sp.max_tokens > eng.max_model_len:
                continue
            toks[i] = []

            def sink(o: RequestOutput, i: int = i) -> None:
                toks[i].extend(o.token_ids)
                if o.finish_reason:
                    ends[i] = (o.finish_reason, o.error)

            eng.submit(f"r{i}", prompt, sp, sink)
        for _ in range(2000):
            if len(ends) == len(toks) and not eng.has_work():
                break
            eng.tick()
        assert eng.leases.violations() == []
        return toks, ends, eng.metrics.preemptions._value.get()

    preempting = 0
    for seed in range(16):
        plain, overlapped = run(seed, False), run(seed, True)
        assert overlapped[:2] == plain[:2], seed
        assert {r for r, _ in overlapped[1].values()} <= {"length", "stop"}, seed
        preempting += overlapped[2] > 0
    assert preempting >= 4
