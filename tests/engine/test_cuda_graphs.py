"""CUDA-graph decode: buckets, and graph decode == eager decode token for token (GPU only)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.cuda_graphs import bucket_for, bucket_sizes
from pdserve.engine.offline import build_engine
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_buckets_are_powers_of_two_to_eight_then_every_eight():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert bucket_sizes(44) == [1, 2, 4, 8, 16, 24, 32, 40, 44]
    assert bucket_sizes(0) == []


@pytest.mark.parametrize(
    "n, want", [(1, 1), (3, 4), (8, 8), (9, 16), (17, 24), (40, 40), (41, None)]
)
def test_a_batch_gets_the_smallest_bucket_that_holds_it(n, want):
    assert bucket_for(n, bucket_sizes(40)) == want


def test_the_cpu_runs_eagerly(tiny_dir):
    engine = build_engine(tiny_dir, attention_backend="torch")
    assert engine.runner.graphs is None


def staggered_run(engine, prompts, max_tokens, join_at):
    """Submit prompts[i] at tick join_at[i], each with its own max_tokens: requests join and
    leave while others decode, so the batch crosses bucket boundaries both ways."""
    outs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    done: set[int] = set()

    def sink(i):
        def put(o: RequestOutput) -> None:
            outs[i].extend(o.token_ids)
            if o.finish_reason is not None:
                assert o.finish_reason == "length", o
                done.add(i)

        return put

    tick = 0
    while len(done) < len(prompts):
        for i, at in enumerate(join_at):
            if at == tick:
                params = SamplingParams(max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True)
                engine.submit(f"r{i}", prompts[i], params, sink(i))
        engine.tick()
        tick += 1
        assert tick < 10_000
    return [outs[i] for i in range(len(prompts))]


@CUDA
def test_graph_decode_equals_eager_decode_token_for_token(tiny_dir):
    g = torch.Generator().manual_seed(3)
    n = 21
    prompts = [
        torch.randint(3, 4000, (int(k),), generator=g).tolist()
        for k in torch.randint(1, 90, (n,), generator=g)
    ]
    max_tokens = [
        200 if i % 3 == 0 else int(k)
        for i, k in enumerate(torch.randint(5, 120, (n,), generator=g))
    ]
    join_at = [0] * 5 + [int(k) for k in torch.randint(1, 150, (n - 5,), generator=g)]
    runs = {}
    # Eager and plain; graphs and plain; graphs and overlapped scheduling (engine/inflight.py).
    for eager, overlap in ((True, False), (False, False), (False, True)):
        engine = build_engine(
            tiny_dir,
            device="cuda",
            attention_backend="triton",
            enforce_eager=eager,
            cuda_graph_max_bs=16,  # buckets 1, 2, 4, 8, 16: 21 requests also run past them
            max_running=32,
            overlap_schedule=overlap,
        )
        assert (engine.runner.graphs is None) == eager
        runs[eager, overlap] = staggered_run(engine, prompts, max_tokens, join_at)
        if not eager:
            assert engine.runner.graphs is not None and engine.runner.graphs.replays > 100
    assert runs[False, False] == runs[True, False]
    assert runs[False, True] == runs[True, False]
    assert [len(o) for o in runs[False, False]] == max_tokens
