"""CUDA-graph prefill: token buckets, and graph prefill == eager prefill token for token (GPU)."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.backend import AttentionContext
from pdserve.engine.cuda_graphs import BucketGraphs, DecodeGraphs, StepGraph, bucket_for
from pdserve.engine.offline import build_engine
from pdserve.engine.prefill_graphs import MAX_SEQS, PrefillGraphs, token_bucket_sizes
from pdserve.engine.scheduler import Chunk
from pdserve.protocol.sampling import SamplingParams
from tests.engine.test_cuda_graphs import staggered_run

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_token_buckets_are_fine_while_small_and_every_256_past_1024():
    assert token_bucket_sizes(2048) == [
        16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048,
    ]  # fmt: skip
    assert token_bucket_sizes(100) == [16, 32, 64, 100]
    assert token_bucket_sizes(16) == [16]
    assert token_bucket_sizes(10) == [10]
    assert token_bucket_sizes(1300) == [*token_bucket_sizes(1280), 1300]
    assert token_bucket_sizes(0) == []
    assert bucket_for(257, token_bucket_sizes(2048)) == 384
    assert bucket_for(2049, token_bucket_sizes(2048)) is None


def test_the_cpu_has_no_prefill_graphs(tiny_dir):
    engine = build_engine(tiny_dir)
    assert engine.runner.prefill_graphs is None


class EagerReplay:
    """Stands in for a captured CUDA graph on the CPU (which has none): `replay` runs the
    model eagerly over the bucket's static tensors, what the captured graph replays."""

    def __init__(self, model, graph: StepGraph, ctx: AttentionContext) -> None:
        self.model, self.static, self.ctx = model, graph, ctx

    def replay(self) -> None:
        g = self.static
        g.hidden.copy_(self.model(g.input_ids, g.positions, self.ctx))


def without_capture(graphs: BucketGraphs) -> BucketGraphs:
    """`graphs` with every bucket's static tensors made as capture makes them, and an eager
    stand-in for the graph."""
    for rows in graphs.sizes:
        buffers, metadata = graphs.static(rows)
        ids = torch.zeros(rows, dtype=torch.int32)
        hidden = torch.empty(rows, graphs.model.arch.hidden_size)
        g = StepGraph(None, ids, torch.zeros_like(ids), buffers, hidden)  # type: ignore[arg-type]
        g.graph = EagerReplay(graphs.model, g, AttentionContext(graphs.backend, metadata))
        graphs.graphs[rows] = g
    return graphs


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the captured graphs below")
def test_a_mixed_step_through_the_static_buckets_equals_the_eager_step(tiny_dir):
    """On the CPU, with Triton's interpreter: a step of three decodes and a 23-token prompt,
    through the runner's graph path (one prefill bucket of 32 tokens: the decodes in its
    decode section, the chunk after them, padded; the graph stood in for by an eager run over
    its static tensors) gives the eager step's logits bit for bit, and so does the prompt's
    next chunk alone, with no decodes."""
    engine = build_engine(
        tiny_dir, attention_backend="triton", max_batched_tokens=64, prefix_cache=False
    )
    runner = engine.runner
    for i in range(3):
        params = SamplingParams(max_tokens=50, temperature=0)
        engine.submit(f"d{i}", list(range(5 + i, 30 + i)), params, lambda _: None)
    for _ in range(3):
        engine.tick()
    engine.sync()
    params = SamplingParams(max_tokens=2, temperature=0)
    prompt = engine.make_request("p", list(range(40, 63)), params, lambda _: None, None)
    engine.scheduler.add(prompt)
    chunks = engine.scheduler.schedule().chunks
    assert [c.length for c in chunks] == [1, 1, 1, 23]
    alone = [Chunk(prompt, 0, 23)]
    with torch.inference_mode():
        eager = [runner.forward(chunks), runner.forward(alone)]
        decode = without_capture(DecodeGraphs(runner.model, runner.backend, 64, 8))
        prefill = without_capture(PrefillGraphs(runner.model, runner.backend, 64, 64, 8))
        runner.graphs, runner.prefill_graphs = decode, prefill  # type: ignore[assignment]
        graphed = runner.forward(chunks)
        assert (decode.replays, prefill.replays) == (0, 1)
        assert prefill.graphs[32].buffers.decode.rows == 8
        assert torch.equal(graphed, eager[0])
        assert torch.equal(runner.forward(alone), eager[1])
    assert prefill.replays == 2


def poison_free_memory(gb: float = 2.0) -> None:
    """Fill `gb` of the CUDA caching allocator's free memory with NaN: the next engine's
    buffers outside its graphs' private pools (the KV pool, the page table, the buckets'
    static metadata) are carved from it, so a kernel that reads a slot it should not (and
    multiplies it by a zero weight) turns a token's logits into NaN instead of reading the
    zeros a fresh allocation often happens to hold."""
    junk = torch.full((int(gb * 2**28),), float("nan"), device="cuda")
    del junk  # back to the allocator's cache, NaNs and all


@CUDA
@pytest.mark.parametrize("budget", [48, 512])
def test_graph_prefill_equals_eager_prefill_token_for_token(tiny_dir, budget):
    """Prompts of 1 to 300 tokens join while others decode: with a step budget of 48 the long
    ones are chunked over several mixed steps (chunks over cached context), with 512 many
    prompts share a step. Eager, graphs, graphs with overlap: the same ids, and the prefill
    graphs replayed (most steps that carried a chunk). Each engine's memory starts as NaN."""
    g = torch.Generator().manual_seed(11)
    n = 24
    prompts = [
        torch.randint(3, 4000, (int(k),), generator=g).tolist()
        for k in torch.randint(1, 300, (n,), generator=g)
    ]
    max_tokens = [int(k) for k in torch.randint(2, 60, (n,), generator=g)]
    join_at = [0] * 6 + [int(k) for k in torch.randint(1, 80, (n - 6,), generator=g)]
    runs = {}
    for eager, overlap in ((True, False), (False, False), (False, True)):
        poison_free_memory()
        engine = build_engine(
            tiny_dir,
            device="cuda",
            attention_backend="triton",
            enforce_eager=eager,
            cuda_graph_max_bs=16,
            max_running=32,
            max_batched_tokens=budget,
            overlap_schedule=overlap,
        )
        graphs = engine.runner.prefill_graphs
        assert (graphs is None) == eager
        runs[eager, overlap] = staggered_run(engine, prompts, max_tokens, join_at)
        if graphs is not None:
            assert graphs.sizes[-1] == budget and graphs.replays > 10
        assert engine.pool.allocator.num_held == 0
    assert runs[False, False] == runs[True, False]
    assert runs[False, True] == runs[True, False]
    assert [len(o) for o in runs[True, False]] == max_tokens


@CUDA
def test_a_step_no_bucket_holds_runs_eagerly(tiny_dir):
    """More chunks than a graph holds (the first step), or more tokens than the largest
    bucket (the long prompt's step): eager, with the same ids as an engine without graphs;
    the decode steps between replay decode graphs."""
    prompts = [[5 + i, 9, 13] for i in range(MAX_SEQS + 3)] + [list(range(3, 700))]
    outs = {}
    for eager in (True, False):
        engine = build_engine(
            tiny_dir,
            device="cuda",
            attention_backend="triton",
            enforce_eager=eager,
            max_running=MAX_SEQS + 8,
            max_batched_tokens=1024,
            cuda_graph_max_tokens=256,
        )
        outs[eager] = staggered_run(engine, prompts, [4] * len(prompts), [0] * (MAX_SEQS + 3) + [2])
        if not eager:
            graphs = engine.runner.prefill_graphs
            assert graphs is not None and graphs.sizes[-1] == 256 and graphs.replays == 0
            assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    assert outs[False] == outs[True]
