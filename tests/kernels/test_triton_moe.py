"""The fused mixture of experts (kernels/moe_align.py, kernels/triton_moe.py) against the torch
loop it replaces (model/moe.py `Experts.loop`), and when the model takes it.

Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET), at small shapes: 8 experts, top_k 2, H 64, I 32. float32 agrees to rounding
(the products' summation order differs); float16 to its rounding; bfloat16 loosely, since the
interpreter converts float32 to bfloat16 by truncating, at every rounding the loop makes.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pdserve.model.deepseek_config import MoEArch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from pdserve.attention.triton_common import interpreted  # noqa: E402
from pdserve.kernels import moe_align, ops, triton_moe  # noqa: E402
from pdserve.model.moe import MoE  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not interpreted(triton_moe._gate_up_kernel):
    pytest.skip("Triton kernels imported compiled without a GPU", allow_module_level=True)

E, TOP_K, H, INTER = 8, 2, 64, 32
ARCH = MoEArch(
    num_experts=E,
    top_k=TOP_K,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    moe_intermediate_size=INTER,
    n_shared_experts=1,
    first_k_dense_replace=0,
)
# BLOCK_M 16 (the least tl.dot takes), N and K blocks that split H and I in two
SMALL = triton_moe.Config(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2)


def moe(dtype: torch.dtype = torch.float32, seed: int = 0) -> MoE:
    g = torch.Generator().manual_seed(seed)
    layer = MoE(ARCH, H)
    with torch.no_grad():
        for p in layer.parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
    layer.gate.e_score_correction_bias.data.mul_(0.1)
    for name, p in layer.named_parameters():
        if not name.startswith("gate."):  # the router stays float32, as the loader keeps it
            p.data = p.data.to(dtype)
    return layer.requires_grad_(False).to(DEVICE)


def tokens(n: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, generator=g).to(dtype).to(DEVICE)


def routing(n: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct experts per token and random weights: [n, TOP_K] each."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(n)])
    return ids.to(DEVICE), torch.rand(n, TOP_K, generator=g).to(DEVICE)


def fused(layer: MoE, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ex = layer.experts
    return triton_moe.fused_moe(x, ids, w, ex.gate_up_proj, ex.down_proj, SMALL)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs().max().clamp_min(1e-6)
    err = float((got.float() - want.float()).abs().max() / scale)
    bound = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 4e-2}[want.dtype]
    assert err <= bound, f"max error {err:.2e} of the largest output, over {bound:.0e}"


# ---------------------------------------------------------------- the alignment


def check_alignment(ids: torch.Tensor, block_m: int, chunk: int) -> None:
    """Every expert's assignments, in order, from a block boundary, padded to whole blocks
    with A; the blocks name their expert; the padded length is the sum of the runs."""
    al = moe_align.align(ids, E, block_m, chunk=chunk)
    flat = ids.reshape(-1).cpu()
    n = flat.numel()
    assert al.sorted_ids.numel() == moe_align.capacity(n, E, block_m)
    total, pos = int(al.total), 0
    sorted_ids, block_expert = al.sorted_ids.cpu(), al.block_expert.cpu()
    for e in range(E):
        mine = torch.nonzero(flat == e).flatten()
        run = -(-len(mine) // block_m) * block_m
        assert torch.equal(sorted_ids[pos : pos + len(mine)].long(), mine)
        assert (sorted_ids[pos + len(mine) : pos + run] == n).all()  # padding
        assert (block_expert[pos // block_m : (pos + run) // block_m] == e).all()
        pos += run
    assert total == pos <= al.sorted_ids.numel()


@pytest.mark.parametrize("n", [1, 5, 9])
@pytest.mark.parametrize("block_m, chunk", [(4, 4), (16, 1024)])
def test_alignment_groups_assignments_by_expert_padded_to_the_block(n, block_m, chunk):
    check_alignment(routing(n)[0], block_m, chunk)  # chunk 4: several passes over the ids


def test_alignment_with_every_token_on_one_expert_and_others_empty():
    ids = torch.tensor([[3, 5]] * 9, device=DEVICE)  # experts 3 and 5: 9 each (3 blocks of 4)
    check_alignment(ids, block_m=4, chunk=8)


def test_capacity_is_the_worst_routing():
    assert moe_align.capacity(8, 256, 16) == 8 * 16  # decode: at most 8 experts, a block each
    assert moe_align.capacity(1024, 256, 64) == (1024 + 256 * 63) // 64 * 64
    # every expert one assignment more than a block: the most padding the bound allows
    ids = torch.arange(E, device=DEVICE).repeat(5).reshape(-1, 2)  # 5 per expert, block 4
    al = moe_align.align(ids, E, 4)
    assert int(al.total) == E * 8 <= moe_align.capacity(ids.numel(), E, 4)


# ---------------------------------------------------------------- the fused experts


@pytest.mark.parametrize("n", [1, 3, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fused_experts_equal_the_loop(n, dtype):
    """9 tokens: 18 assignments, not a multiple of the block; 1 token: 6 experts get none."""
    layer, x = moe(dtype), tokens(n, dtype)
    ids, w = routing(n)
    assert_matches(fused(layer, x, ids, w), layer.experts.loop(x, ids, w))


def test_every_token_on_the_same_experts():
    layer, x = moe(), tokens(20)  # 20 assignments on each of two experts: two blocks each
    ids = torch.tensor([[6, 1]] * 20, device=DEVICE)
    w = torch.rand(20, 2, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    assert_matches(fused(layer, x, ids, w), layer.experts.loop(x, ids, w))


def test_the_default_blocks_and_no_tokens():
    layer, x = moe(), tokens(4)
    ids, w = routing(4)
    ex = layer.experts
    got = triton_moe.fused_moe(x, ids, w, ex.gate_up_proj, ex.down_proj)  # config_for's blocks
    assert_matches(got, ex.loop(x, ids, w))
    empty = triton_moe.fused_moe(x[:0], ids[:0], w[:0], ex.gate_up_proj, ex.down_proj)
    assert empty.shape == (0, H)


def test_mismatched_operands_are_refused():
    layer, x = moe(), tokens(2)
    ids, w = routing(2)
    ex = layer.experts
    with pytest.raises(ValueError, match="fused_moe"):
        triton_moe.fused_moe(x.bfloat16(), ids, w, ex.gate_up_proj, ex.down_proj)
    with pytest.raises(ValueError, match="fused_moe"):
        triton_moe.fused_moe(x, ids, w, ex.gate_up_proj, ex.down_proj.transpose(1, 2))


def test_config_rule():
    """Decode (few rows per expert) takes the smallest blocks; a long prefill larger ones;
    every side at least tl.dot's 16 and a power of two, within small H and I."""
    decode = triton_moe.config_for(1, 7168, 2048, 8, 256)
    prefill = triton_moe.config_for(8192, 7168, 2048, 8, 256)
    assert decode.block_m == 16 < prefill.block_m
    small = triton_moe.config_for(4, 64, 16, 2, 8, torch.float32)
    for c in (decode, prefill, small):
        for side in (c.block_m, c.block_n, c.block_k):
            assert side >= 16 and side & (side - 1) == 0
    assert small.block_n == small.block_k == 16


# ---------------------------------------------------------------- the model's choice


def test_the_layer_takes_the_fused_path_on_cuda_or_when_forced(monkeypatch):
    layer, x = moe(), tokens(5)
    monkeypatch.delenv(ops.FUSED_MOE_ENV, raising=False)
    assert ops.fused_moe_applies(x) == (DEVICE == "cuda")
    monkeypatch.setenv(ops.FUSED_MOE_ENV, "0")
    assert not ops.fused_moe_applies(x)
    loop = layer(x)
    monkeypatch.setenv(ops.FUSED_MOE_ENV, "1")
    assert ops.fused_moe_applies(x)
    assert_matches(layer(x), loop)  # router, fused experts and shared expert: the same layer


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
def test_on_cuda_no_host_sync_and_a_cuda_graph_replays_new_routing():
    layer, x = moe(torch.bfloat16), tokens(9, torch.bfloat16)
    layer(x)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x)  # router and fused experts: a host sync would raise
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static)
    for seed in (5, 6):
        static.copy_(tokens(9, torch.bfloat16, seed=seed))
        graph.replay()
        assert torch.equal(out, layer(static))
