"""Greedy parity: pdserve's engine vs HF transformers' generate, exact token ids.

Prompts end exactly at, just before and just after page and prefill-chunk boundaries, and
generation crosses page boundaries during decode. transformers is a test dependency only.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.protocol.sampling import SamplingParams
from tests.helpers import hf_greedy, make_engine, run

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def prompts_for(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize(
    "name, page_size, chunk",
    [
        ("tiny", 16, 32),
        ("tiny", 8, 20),
        ("qwen3-tiny", 16, 32),
        ("qwen3-tiny", 8, 20),
        # qwen2-tiny (its q/k/v biases) at one geometry: the paging boundaries are the same
        # code for every model, and at (8, 20) it was the suite's second-slowest test (60-80 s)
        ("qwen2-tiny", 16, 32),
    ],
)
def test_greedy_matches_hf(builtin_dir, name, page_size, chunk):
    path = builtin_dir(name)
    lengths = sorted(
        {
            1,
            2,
            page_size - 1,
            page_size,
            page_size + 1,
            chunk - 1,
            chunk,
            chunk + 1,
            2 * chunk - 1,
            2 * chunk,
            2 * chunk + 1,
            3 * page_size,
            100,
        }
    )
    engine = make_engine(path, page_size=page_size, chunk=chunk)
    prompts = prompts_for(2000, lengths)
    alone = [run(engine, [p], GREEDY)[0] for p in prompts]
    ref = hf_greedy(path, prompts, NEW_TOKENS)
    mismatched = [(n, a, r) for n, a, r in zip(lengths, alone, ref, strict=True) if a != r]
    assert not mismatched, f"{name}: prompt length, ours, HF: {mismatched[:2]}"
    assert engine.pool.allocator.num_held == 0


def test_concurrent_equals_alone(tiny_dir):
    engine = make_engine(tiny_dir, page_size=16, chunk=64)
    lengths = [3, 9, 15, 16, 17, 22, 31, 32, 33, 40, 47, 48, 49, 60, 64, 90]
    prompts = prompts_for(2000, lengths, seed=1)
    alone = [run(engine, [p], GREEDY)[0] for p in prompts]
    together = run(engine, prompts, GREEDY)
    assert together == alone
    assert engine.pool.allocator.num_held == 0


def test_preemption_keeps_greedy_output(tiny_dir):
    """A pool too small for all requests forces recompute; outputs must not change."""
    prompts = prompts_for(2000, [40, 41, 42, 43, 44, 45], seed=2)
    roomy = make_engine(tiny_dir, page_size=8, chunk=64)
    expected = run(roomy, prompts, GREEDY)
    pool_bytes = roomy.pool.layout.bytes_per_page_all_layers * 24  # 192 tokens for 6 x 64
    tight = make_engine(
        tiny_dir, page_size=8, chunk=64, kv_mb=pool_bytes / 2**20, max_model_len=128
    )
    assert run(tight, prompts, GREEDY) == expected
    assert tight.metrics.preemptions._value.get() > 0
    assert tight.pool.allocator.num_held == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", ["tiny", "qwen2-tiny", "qwen3-tiny"])
def test_greedy_matches_hf_on_the_gpu_with_graphs(builtin_dir, name):
    """float32 on the GPU, the triton backend, decode and prefill chunks through CUDA graphs:
    HF's ids exactly (HF on the CPU, float32)."""
    from pdserve.engine.offline import build_engine

    path = builtin_dir(name)
    lengths = [1, 2, 15, 16, 17, 31, 32, 33, 64, 100]
    engine = build_engine(
        path,
        device="cuda",
        page_size=16,
        max_batched_tokens=32,
        attention_backend="triton",
        cuda_graph_max_bs=16,
    )
    assert engine.runner.graphs is not None
    prompts = prompts_for(2000, lengths, seed=5)
    together = run(engine, prompts, GREEDY)
    ref = hf_greedy(path, prompts, NEW_TOKENS)
    mismatched = [(n, a, r) for n, a, r in zip(lengths, together, ref, strict=True) if a != r]
    assert not mismatched, f"{name}: prompt length, ours, HF: {mismatched[:2]}"
    assert engine.runner.graphs.replays > 0 and engine.pool.allocator.num_held == 0
    assert engine.runner.prefill_graphs is not None and engine.runner.prefill_graphs.replays > 0
