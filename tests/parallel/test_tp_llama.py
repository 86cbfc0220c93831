"""Tensor parallelism on the CPU: the Llama family at TP 2 and 4 over gloo gives the TP-1 logits.

Each rank is a spawned process (tests/parallel/ranks.py) that loads its shard of a built-in
model from the checkpoint, keeps its own KV pool of its KV heads, and runs two steps through
the torch backend's paged attention (prefills, a chunk over stored KV, decodes); its logits,
gathered whole on every rank, match the TP-1 model's (float32: within 1e-4, the same argmax).
The models cover the family's variants: tiny (Llama: tied head, llama3 RoPE, 4 KV heads: split
at TP 4), qwen2-tiny (q/k/v bias, its own head), qwen3-tiny (q/k norms, 2 KV heads: replicated
at TP 4). Each parallel layer is checked against the plain product on a vocab no group splits
evenly, and a collective a peer skips ends at the group's timeout.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kvcache.layout import KVLayout
from pdserve.model.config import ModelArch, ModelConfigError
from pdserve.model.llama import CausalLM, Linear
from pdserve.parallel.group import RankGroup
from pdserve.parallel.layers import ColumnParallelLinear, Part, ShardError, vocab_rows
from tests.parallel import ranks
from tests.parallel.ranks import HEAD_DIM, KV_HEADS, Q_HEADS, VOCAB, forward_steps, spawn

MODELS = {2: ("tiny", "qwen2-tiny"), 4: ("tiny", "qwen3-tiny")}


def fake(rank: int, world: int) -> Any:
    """What the sharding reads of a RankGroup, without a process group."""
    return SimpleNamespace(rank=rank, world_size=world)


# ---------------------------------------------------------------- sharding, without processes


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_a_part_s_rows_tile_it_over_the_ranks(world):
    part = Part(8 * 4, 8)  # 8 heads of 4
    rows = [part.rows(fake(r, world)) for r in range(world)]
    assert [i for r in rows for i in r] == list(range(32))
    assert {len(r) for r in rows} == {32 // world}


def test_fewer_units_than_ranks_are_replicated_to_the_ranks_that_read_them():
    kv = Part(2 * 4, 2)  # 2 KV heads for 8 query heads: query heads 0-3 read KV head 0
    assert [kv.rows(fake(r, 4), replicate=True) for r in range(4)] == [
        range(0, 4), range(0, 4), range(4, 8), range(4, 8)
    ]  # fmt: skip
    with pytest.raises(ShardError, match="2 units of 4 features do not split over 4 ranks"):
        kv.rows(fake(0, 4))  # a row-parallel input is never replicated
    with pytest.raises(ShardError, match="3 units of 4 features do not split over 2 ranks"):
        Part(12, 3).rows(fake(0, 2), replicate=True)


def test_the_vocab_is_split_in_equal_rows_the_last_padded():
    assert [vocab_rows(11, fake(r, 4)) for r in range(4)] == [
        (0, 3, 3), (3, 3, 3), (6, 3, 3), (9, 2, 3)
    ]  # fmt: skip
    assert vocab_rows(5, fake(3, 4)) == (6, 0, 2)  # a rank past the vocab holds padding only


def test_load_shard_takes_each_member_s_rows_and_refuses_a_stranger():
    q, kv = 4 * 2, 2 * 2  # 4 heads and 2 KV heads of 2
    layer = ColumnParallelLinear(3, (Part(q, 4), Part(kv, 2), Part(kv, 2)), False, fake(1, 2))
    whole = torch.arange(float((q + 2 * kv) * 3)).view(-1, 3)
    layer.load_shard("weight", whole[q:], q)  # k and v together, then q
    layer.load_shard("weight", whole[:q], 0)
    assert torch.equal(layer.weight, whole[[4, 5, 6, 7, 10, 11, 14, 15]])
    assert layer.whole_shape("weight") == (q + 2 * kv, 3)
    with pytest.raises(ShardError, match=r"a tensor of \(4, 3\) at row 14 is not part of"):
        layer.load_shard("weight", whole[:4], 14)


def test_for_rank_splits_the_heads_and_refuses_what_does_not_split(tiny_dir: Path):
    arch = ModelArch.from_dir(tiny_dir)  # 8 heads, 4 KV heads, MLP 704
    assert arch.for_rank(1, 0) is arch
    assert (arch.for_rank(2, 1).num_heads, arch.for_rank(2, 1).num_kv_heads) == (4, 2)
    assert (arch.for_rank(8, 7).num_heads, arch.for_rank(8, 7).num_kv_heads) == (1, 1)
    assert arch.for_rank(4, 0).vocab_size == arch.vocab_size
    with pytest.raises(ModelConfigError, match="num_attention_heads 8 does not split over 3"):
        arch.for_rank(3, 0)
    odd_kv = ModelArch(**{**vars(arch), "num_heads": 12, "num_kv_heads": 3})
    with pytest.raises(ModelConfigError, match="num_key_value_heads 3 neither splits over 4"):
        odd_kv.for_rank(4, 0)
    with pytest.raises(ValueError, match="rank 2 is not one of 2"):
        arch.for_rank(2, 2)


def test_the_kv_layout_of_a_rank_names_it_and_holds_its_heads(tiny_dir: Path):
    arch = ModelArch.from_dir(tiny_dir).for_rank(4, 3)
    layout = KVLayout.for_model(arch, "float32", 16, tp_rank=3, tp_size=4)
    assert (layout.num_kv_heads, layout.tp_rank, layout.tp_size) == (1, 3, 4)
    whole = KVLayout.for_model(ModelArch.from_dir(tiny_dir), "float32", 16)
    assert layout.page_bytes * 4 == whole.page_bytes


def test_tp1_builds_today_s_model_and_tp2_its_shard_under_the_same_names(tiny_dir: Path):
    arch = ModelArch.from_dir(tiny_dir)
    with torch.device("meta"):
        model = CausalLM(arch, RankGroup.single())
        shard = CausalLM(arch, fake(1, 2))
    assert model.arch is arch
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    layer = model.model.layers[0]
    assert {type(layer.self_attn.qkv_proj), type(layer.mlp.down_proj)} == {Linear}
    whole = {n: tuple(p.shape) for n, p in model.named_parameters()}
    names = [n for n, _ in shard.named_parameters()]
    assert names == list(whole)
    sharded = {n: tuple(p.shape) for n, p in shard.named_parameters()} != whole
    assert sharded and shard.arch.num_heads == arch.num_heads // 2


# ---------------------------------------------------------------- ranks in processes


@pytest.fixture(scope="module", params=[2, 4])
def tp(request, builtin_dir, tmp_path_factory) -> tuple[int, list[list[Any]], dict[str, Any]]:
    """(world, each rank's results, the TP-1 results by model): the layers job, then each
    model's forward."""
    world = request.param
    dirs = {name: builtin_dir(name) for name in MODELS[world]}
    jobs: list[tuple[str, tuple[Any, ...]]] = [("layers", ())]
    jobs += [("forward", (str(d),)) for d in dirs.values()]
    jobs += [("dp_exchange", ())]
    out = spawn(world, jobs, tmp_path_factory.mktemp(f"tp{world}"), timeout_s=180.0)
    single = {name: forward_steps(d, RankGroup.single()) for name, d in dirs.items()}
    return world, out, single


def test_each_rank_s_logits_are_the_tp1_logits(tp):
    world, out, single = tp
    for m, name in enumerate(MODELS[world], start=1):
        want = single[name]["logits"]
        for rank in range(world):
            got = out[rank][m]["logits"]
            for step, (g, w) in enumerate(zip(got, want, strict=True)):
                where = f"{name} at TP {world}, rank {rank}, step {step + 1}"
                assert g.shape == w.shape, where
                diff = (g - w).abs().max().item()
                # float32 sums over the ranks' partials in another order: 1e-4 plus 1e-5 of
                # the largest logit (a TP-4 qwen3-tiny step measured 1.07e-4 here)
                bound = 1e-4 + 1e-5 * w.abs().max().item()
                assert diff < bound, f"{where}: max abs diff {diff} (bound {bound:.3g})"
                assert torch.equal(g.argmax(-1), w.argmax(-1)), where
                assert torch.equal(g, out[0][m]["logits"][step]), f"{where}: ranks differ"


def test_each_rank_s_pool_holds_its_kv_heads_only(tp):
    world, out, single = tp
    for m, name in enumerate(MODELS[world], start=1):
        heads, kv_heads, _ = single[name]["heads"]
        want = [heads // world, max(1, kv_heads // world), max(1, kv_heads // world)]
        assert [out[r][m]["heads"] for r in range(world)] == [want] * world, name


def test_each_parallel_layer_matches_torch_s(tp):
    world, out, _ = tp
    w = ranks.layer_weights()
    qkv = F.linear(w["x"], w["qkv.weight"], w["qkv.bias"])  # [T, q | k | v]
    q, kv, group = Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, Q_HEADS // KV_HEADS
    for rank in range(world):
        got = out[rank][0]
        heads = range(rank * Q_HEADS // world, (rank + 1) * Q_HEADS // world)
        kv_heads = sorted({h // group for h in heads})  # the KV heads its query heads read

        def cols(base: int, hs: list[int] | range) -> list[int]:
            return [base + h * HEAD_DIM + i for h in hs for i in range(HEAD_DIM)]

        want = qkv[:, cols(0, heads) + cols(q, kv_heads) + cols(q + kv, kv_heads)]
        torch.testing.assert_close(got["qkv"], want, rtol=0, atol=1e-5)
        o = F.linear(w["o.x"], w["o.weight"], w["o.bias"])
        torch.testing.assert_close(got["o"], o, rtol=0, atol=1e-5)
        assert torch.equal(got["embed"], F.embedding(w["ids"], w["embed.weight"]))
        head = F.linear(w["x"], w["embed.weight"])
        assert got["head"].shape == (w["x"].shape[0], VOCAB)
        torch.testing.assert_close(got["head"], head, rtol=0, atol=1e-5)


def test_a_collective_a_peer_skips_raises_at_the_group_timeout(tmp_path):
    bound = 5.0
    out = spawn(2, [("stall", (bound + 1.5,))], tmp_path, timeout_s=60.0, group_timeout_s=bound)
    kind, message, waited = out[0][0]
    assert kind == "CollectiveError"
    assert message.startswith("rank 0 of 2: all_reduce_sum of (3,) failed (bound 5.0 s")
    assert bound * 0.9 <= waited < bound + 10.0


def test_data_parallel_rows_are_gathered_and_each_rank_keeps_its_sum(tp):
    """parallel/dp_tokens.py over real ranks: uneven counts, one rank with none."""
    world, out, _ = tp
    counts = ranks.dp_counts(world)
    every = torch.cat([ranks.dp_rows(r, n, 0) for r, n in enumerate(counts)])
    summed = sum(ranks.dp_rows(r, sum(counts), 7) for r in range(world))
    for rank in range(world):
        got = out[rank][-1]
        assert torch.equal(got["gathered"], every), rank
        first = sum(counts[:rank])
        assert torch.equal(got["own"], summed[first : first + counts[rank]]), rank
