"""A failure inside a step fails its own request only: the other rows of the batch go on with
exactly the tokens they would have had (issue 17 part 3, LESSONS #16)."""

from __future__ import annotations

import pytest

from pdserve.engine.request import RequestOutput
from pdserve.protocol.sampling import SamplingParams
from tests.helpers import make_engine

N = 16
POISONED = 5
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(5 + i)] for i in range(N)]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, seed=11, ignore_eos=True)


def run(eng, params: SamplingParams) -> dict[str, tuple[list[int], RequestOutput]]:
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(N)}
    ends: dict[str, RequestOutput] = {}
    for i, prompt in enumerate(PROMPTS):

        def sink(o: RequestOutput, rid: str = f"r{i}") -> None:
            outs[rid].extend(o.token_ids)
            if o.finish_reason is not None:
                ends[rid] = o

        eng.submit(f"r{i}", prompt, params, sink)
    for _ in range(2000):
        if len(ends) == N:
            break
        eng.tick()
    assert len(ends) == N, f"{N - len(ends)} requests did not end"
    return {rid: (outs[rid], ends[rid]) for rid in outs}


def poison_sampling(eng, monkeypatch) -> None:
    """Both the batch's launch and the row-by-row fallback raise for the poisoned row."""
    for owner, name in ((eng.sampler, "launch"), (eng.sampler, "sample")):
        real = getattr(owner, name)

        def poisoned(logits, reqs, real=real):
            if any(r.request_id == f"r{POISONED}" for r in reqs):
                raise FloatingPointError("a row that cannot be sampled")
            return real(logits, reqs)

        monkeypatch.setattr(owner, name, poisoned)


def poison_forward(eng, monkeypatch) -> None:
    real = eng.runner.forward

    def forward(chunks, feed=None):
        if any(c.request.request_id == f"r{POISONED}" for c in chunks):
            raise RuntimeError("a chunk the model cannot run")
        return real(chunks, feed)

    monkeypatch.setattr(eng.runner, "forward", forward)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("where", ["sample", "forward"])
def test_one_failing_row_fails_alone(tiny_dir, monkeypatch, params, where):
    clean = run(make_engine(tiny_dir, chunk=512), params)
    eng = make_engine(tiny_dir, chunk=512)  # one step holds every prompt: one shared batch
    if where == "sample":
        poison_sampling(eng, monkeypatch)
    else:
        poison_forward(eng, monkeypatch)
    dirty = run(eng, params)
    bad = dirty.pop(f"r{POISONED}")
    assert bad[1].finish_reason == "error" and "cannot" in (bad[1].error or "")
    clean.pop(f"r{POISONED}")
    for rid, (tokens, end) in dirty.items():
        assert end.finish_reason == "length", (rid, end)
        assert tokens == clean[rid][0], rid  # byte-identical to the clean run
    assert eng.metrics.step_errors._value.get() >= 1  # noqa: SLF001 - the failure was counted
    assert eng.pool.allocator.num_held == 0  # nothing leaked (cached pages are free to evict)
