"""Prefill batching (`--prefill-wait-steps`, engine/scheduler.py): while requests decode, new
requests wait at most N steps and then start together; never in a step without decodes, and at
once when their tokens fill the budget. The tokens are those of starting at once."""

from __future__ import annotations

import argparse

import pytest

from pdserve.config import MAX_PREFILL_WAIT_STEPS, SchedulerConfig
from pdserve.engine.params import SamplingParams
from pdserve.engine.request import Event
from pdserve.engine.scheduler import StepPlan
from pdserve.engine_flags import add_engine_args, engine_config
from pdserve.launch import engine_flags
from tests.engine.test_overlap import run
from tests.engine.test_scheduler import finish_step, req, sched
from tests.helpers import make_engine


def started(plan: StepPlan) -> list[str]:
    """The requests whose prefill begins in this step."""
    return [c.request.request_id for c in plan.chunks if c.start == 0 and c.length > 1]


def decoding(s, rid: str = "a", prompt: int = 4):
    """`s` with one request past its prefill, decoding."""
    s.add(req(rid, prompt))
    finish_step(s.schedule())
    return s


def test_waiting_requests_start_together_after_n_steps():
    s = decoding(sched(64, max_batched_tokens=64, max_running=8, prefill_wait_steps=3))
    s.add(req("b", 5))
    begun = []
    for step in range(6):
        if step == 1:
            s.add(req("c", 6))
        plan = s.schedule()
        assert plan.chunks[0].request.request_id == "a"  # the decode goes on every step
        begun.append(started(plan))
        finish_step(plan)
    assert begun == [[], [], [], ["b", "c"], [], []]


def test_no_wait_starts_at_once():
    s = decoding(sched(64, max_batched_tokens=64, max_running=8))
    s.add(req("b", 5))
    assert started(s.schedule()) == ["b"]


def beside_a_last_chunk(prompt: int) -> list[tuple[str, int]]:
    """The step after a `prompt`-token prompt's first 8-token chunk, a new request added
    meanwhile: (request, tokens) of each chunk."""
    s = sched(64, max_batched_tokens=8, max_running=8, prefill_wait_steps=5)
    s.add(req("long", prompt))
    finish_step(s.schedule())
    s.add(req("b", 3))
    return [(c.request.request_id, c.length) for c in s.schedule().chunks]


def test_nothing_waits_in_a_step_without_decodes():
    """An idle engine (or a prefill worker, whose steps carry no decodes) starts at once; so
    does a request beside a prompt's last chunk, even one of one token (no output yet: not a
    decode)."""
    s = sched(64, max_batched_tokens=64, max_running=8, prefill_wait_steps=5)
    s.add(req("a", 5))
    assert started(s.schedule()) == ["a"]
    assert beside_a_last_chunk(12) == [("long", 4), ("b", 3)]
    assert beside_a_last_chunk(9) == [("long", 1), ("b", 3)]


def test_a_full_budget_starts_at_once():
    s = decoding(sched(64, max_batched_tokens=16, max_running=8, prefill_wait_steps=50))
    s.add(req("b", 8))
    assert started(s.schedule()) == []  # 8 of the 15 tokens the decode leaves: held
    s.add(req("c", 7))  # 15 now: the step is full
    plan = s.schedule()
    assert started(plan) == ["b", "c"] and plan.num_tokens == 16


def test_steady_arrivals_start_in_groups_every_n_plus_one_steps():
    """One arrival a step: each group waits N steps from its oldest request's arrival, and
    the pattern repeats (no request waits longer, none starts alone)."""
    n = 4
    s = decoding(sched(256, max_batched_tokens=512, max_running=64, prefill_wait_steps=n))
    arrived: dict[str, int] = {}
    groups: list[tuple[int, list[int]]] = []  # (step, how long each of the group waited)
    for step in range(40):
        rid = f"r{step}"
        s.add(req(rid, 3, max_tokens=1000))
        arrived[rid] = step
        plan = s.schedule()
        if started(plan):
            groups.append((step, [step - arrived[r] for r in started(plan)]))
        finish_step(plan)
    assert [step for step, _ in groups] == list(range(n, 40, n + 1))
    assert all(waited == list(range(n, -1, -1)) for _, waited in groups)


def test_a_request_due_starts_as_soon_as_it_can():
    """Held past its N steps because no slot was free: it starts the step one frees, not N
    steps later."""
    s = decoding(sched(64, max_batched_tokens=64, max_running=2, prefill_wait_steps=2), "a")
    s.add(req("b", 3, max_tokens=1000))
    for _ in range(3):  # b waits 2 steps, then starts
        plan = s.schedule()
        finish_step(plan)
    assert [r.request_id for r in s.running] == ["a", "b"]
    s.add(req("c", 3))
    for _ in range(5):  # due after 2 steps, but no slot
        assert started(s.schedule()) == []
    s.finish(s.running[0], Event.LENGTH)
    assert started(s.schedule()) == ["c"]


def test_a_preempted_request_is_not_held():
    s = decoding(sched(64, max_batched_tokens=64, max_running=8, prefill_wait_steps=50))
    back = req("back", 6)
    back.num_preemptions = 1
    s.waiting.appendleft(back)  # where _preempt puts it, with no arrival step
    assert started(s.schedule()) == ["back"]


@pytest.mark.parametrize("bad", [-1, MAX_PREFILL_WAIT_STEPS + 1])
def test_the_wait_is_bounded(bad: int):
    with pytest.raises(ValueError, match="prefill wait"):
        SchedulerConfig(prefill_wait_steps=bad)


def test_the_flag_reaches_the_scheduler_and_launch_passes_it_on():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--model", "builtin:tiny", "--prefill-wait-steps", "6"])
    assert engine_config(args).scheduler.prefill_wait_steps == 6
    flags = engine_flags(args)
    assert flags[flags.index("--prefill-wait-steps") + 1] == "6"


def test_tokens_are_those_of_starting_at_once(tiny_dir):
    """Greedy and seeded requests arriving one a step: the same tokens with a wait, and fewer
    steps carry a prompt."""
    jobs = [
        (
            [(7 * i + 3 * j) % 250 + 3 for j in range(4 + 3 * (i % 4))],
            SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.8, seed=i),
        )
        for i in range(12)
    ]
    results, prompt_steps = [], []
    for wait in (0, 3):
        eng = make_engine(tiny_dir, chunk=64, prefill_wait_steps=wait)
        plans: list[StepPlan] = []
        schedule = eng.scheduler.schedule

        def spy(schedule=schedule, plans=plans) -> StepPlan:
            plans.append(schedule())
            return plans[-1]

        eng.scheduler.schedule = spy  # type: ignore[method-assign]
        results.append(run(eng, jobs, stagger=1))
        prompt_steps.append(sum(1 for p in plans if started(p)))
    assert results[0] == results[1]
    assert prompt_steps[1] < prompt_steps[0]
