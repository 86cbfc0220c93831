"""The fused mixture of experts with block-quantised fp8 experts (kernels/triton_moe_fp8.py,
through kernels/triton_moe.fused_moe) against the block-scaled loop it must equal: x quantised
once per token per group of 128, each expert's gate-up product block-scaled, silu * up in the
model's dtype, h quantised the same way, the down product block-scaled, weighed, and summed per
token in expert index order (`loop`, the oracle model/moe.py's loop follows for fp8 experts);
with `pow2` (ue8m0 checkpoints) x's and h's group scales rounded up to powers of two.

Without a GPU the kernels run in Triton's CPU interpreter, where a block's e4m3 products are
exact and summed in float32, as the oracle sums them: float32 agrees to rounding. Except where
h falls within float32 rounding of an e4m3 rounding boundary: the two sums may then quantise
it to neighbouring e4m3 values, an error of up to an e4m3 step in one h value; the oracle marks
those tokens (`unsteady`) and they are held to the loose bound. bfloat16 agrees loosely: the
interpreter converts float32 to bfloat16 by truncation at each of the loop's roundings, and
each such difference in h moves some of its e4m3 values a step. On a GPU Hopper's fp8 MMA
sums a block's products in fewer bits than float32, so every dtype gets the loose bound there.

The weights' 128 x 128 blocks have magnitudes 2**-3 .. 2**3 at random, and so scales as
different: a scale read from the wrong block is off by up to 64x.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from pdserve.attention.triton_common import interpreted  # noqa: E402
from pdserve.kernels import fp8_blocks, ops, reference, triton_moe, triton_moe_fp8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not interpreted(triton_moe_fp8._gate_up_kernel):
    pytest.skip("Triton kernels imported compiled without a GPU", allow_module_level=True)

E, TOP_K, B = 8, 2, fp8_blocks.BLOCK
TIGHT = 1e-5  # float32 sums in another order
LOOSE = 8e-2  # bfloat16 truncated under the interpreter, or the GPU's fp8 MMA; h re-quantised
STEADY = 2**-18  # h this close (relatively) to an e4m3 rounding boundary may round either way


class Experts(NamedTuple):
    gate_up: torch.Tensor  # [E, 2I, H] e4m3
    gate_up_scale: torch.Tensor  # [E, ceil(2I / B), ceil(H / B)] float32
    down: torch.Tensor  # [E, H, I] e4m3
    down_scale: torch.Tensor  # [E, ceil(H / B), ceil(I / B)] float32


def quantised(rows: int, cols: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """E random [rows, cols] weights, each 128 x 128 block scaled by 2**-3 .. 2**3, in
    DeepSeek's fp8 format."""
    qs, scales = [], []
    for _ in range(E):
        w = torch.randn(rows, cols, generator=g) / cols**0.5
        mag = 2.0 ** torch.randint(-3, 4, (-(-rows // B), -(-cols // B)), generator=g)
        w *= mag.repeat_interleave(B, 0)[:rows].repeat_interleave(B, 1)[:, :cols]
        q, s = fp8_blocks.quantize_weight(w)
        qs.append(q)
        scales.append(s)
    return torch.stack(qs), torch.stack(scales)


def experts(hidden: int, inter: int, seed: int = 0) -> Experts:
    g = torch.Generator().manual_seed(seed)
    gate_up, gate_up_scale = quantised(2 * inter, hidden, g)
    down, down_scale = quantised(hidden, inter, g)
    return Experts(*(t.to(DEVICE) for t in (gate_up, gate_up_scale, down, down_scale)))


def tokens(n: int, hidden: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def routing(n: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct experts per token and random weights: [n, TOP_K] each."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(n)])
    return ids, torch.rand(n, TOP_K, generator=g)


def unsteady_rows(h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[R] bool: the rows of h [R, I] (group scales [R, ceil(I / B)]) with a value whose e4m3
    rounding changes when the value moves by STEADY of itself."""
    v = h.float() / scale.repeat_interleave(B, 1)[:, : h.shape[1]]
    q = v.to(fp8_blocks.FP8_DTYPE).float()
    moved = [(v * (1 + d)).to(fp8_blocks.FP8_DTYPE).float() for d in (STEADY, -STEADY)]
    return ((moved[0] != q) | (moved[1] != q)).any(dim=1)


def loop(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ex: Experts, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: (out [N, H] in x's dtype, [N] bool: the tokens with an unsteady h)."""
    out = torch.zeros_like(x)
    unsteady = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    xq, xs = fp8_blocks.act_quant(x, pow2=pow2)  # once: every expert of a token reads the same
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        g = fp8_blocks.block_linear(
            xq[token], xs[token], ex.gate_up[e], ex.gate_up_scale[e], x.dtype
        )  # [n, 2I]
        h = reference.silu_mul(g)  # [n, I]
        hq, hs = fp8_blocks.act_quant(h, pow2=pow2)
        unsteady[token] |= unsteady_rows(h, hs)
        y = fp8_blocks.block_linear(hq, hs, ex.down[e], ex.down_scale[e], x.dtype)  # [n, H]
        out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
    return out, unsteady


def fused(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    ex: Experts,
    config: triton_moe.Config | None = None,
    pow2: bool = False,
) -> torch.Tensor:
    return triton_moe.fused_moe(
        x, ids, weights, ex.gate_up, ex.down, config,
        gate_up_scale=ex.gate_up_scale, down_scale=ex.down_scale, pow2=pow2,
    )  # fmt: skip


def check(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    ex: Experts,
    config: triton_moe.Config | None = None,
    pow2: bool = False,
) -> None:
    """The fused experts equal the loop: each token's row within TIGHT of the largest output
    where the sums are float32 throughout and its h is steady, else within LOOSE."""
    x, ids, weights = x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE)
    got = fused(x, ids, weights, ex, config, pow2)
    want, unsteady = loop(x, ids, weights, ex, pow2)
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs().max().clamp_min(1e-6)
    row_err = (got.float() - want.float()).abs().amax(dim=1) / scale  # [N]
    if DEVICE == "cpu" and x.dtype == torch.float32:
        assert unsteady.float().mean() <= 0.25, "the tight bound would check too few tokens"
        bound = torch.where(unsteady, LOOSE, TIGHT)
    else:
        bound = torch.full_like(row_err, LOOSE)
    bad = torch.nonzero(row_err > bound).flatten().tolist()
    assert not bad, f"tokens {bad}: errors {row_err[bad].tolist()} of the largest output"


# ---------------------------------------------------------------- against the loop


@pytest.mark.parametrize("n", [1, 7, 40])
@pytest.mark.parametrize("hidden, inter", [(128, 64), (256, 192)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_equal_the_block_scaled_loop(dtype, hidden, inter, n):
    """I 64: gate and up share a scale row and K is one short block; I 192: gate rows 128..191
    and up rows 192..383 span scale rows 1 and 2, and the down product's K ends in a half
    block. 1 token: six experts get none; 40: 80 assignments, not a multiple of the block."""
    ids, w = routing(n, seed=n)
    check(tokens(n, hidden, dtype, seed=n + 1), ids, w, experts(hidden, inter, seed=inter))


@pytest.mark.parametrize("n", [7, 40])
@pytest.mark.parametrize("hidden, inter", [(128, 64), (192, 192)])
def test_pow2_scales_equal_the_pow2_loop(hidden, inter, n):
    """Power-of-two scales for x and h (ue8m0 checkpoints): the fused experts equal the loop
    that rounds them so, whose outputs are not the plain loop's (at several times LOOSE, so
    a kernel that dropped pow2 for x or for h fails)."""
    ids, w = routing(n, seed=n + 20)
    x = tokens(n, hidden, torch.float32, seed=n + 21)
    ex = experts(hidden, inter, seed=inter + 22)
    check(x, ids, w, ex, pow2=True)
    xd, idsd, wd = x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE)
    want = loop(xd, idsd, wd, ex, pow2=True)[0]
    plain = loop(xd, idsd, wd, ex)[0]
    assert (plain - want).abs().max() > 0.5 * LOOSE * want.abs().max()


def test_tiles_that_straddle_scale_blocks():
    """BLOCK_N 128 with I 192: the up tile of columns 0..127 holds up rows 192..319, in scale
    rows 1 and 2 both, beside a gate tile wholly in row 0 (the first up tile of
    test_fp8_experts_equal_the_block_scaled_loop's BLOCK_N 32 never straddles); BLOCK_N 16:
    eight tiles per scale row. One scale per tile would fail the first."""
    ex = experts(256, 192, seed=3)
    ids, w = routing(7, seed=4)
    x = tokens(7, 256, torch.float32, seed=5)
    for block_n in (128, 16):
        check(x, ids, w, ex, triton_moe.Config(16, block_n, B, num_warps=4, num_stages=2))


def test_a_short_last_block_of_h():
    """H 192: the gate-up product's K ends in a half block (x's last group is 64 wide), and the
    down product's output rows 128..191 take scale row 1."""
    ids, w = routing(7, seed=10)
    check(tokens(7, 192, torch.float32, seed=11), ids, w, experts(192, 64, seed=12))


def test_many_blocks_per_expert():
    """40 tokens all on experts 6 and 1: 40 assignments each, three blocks of 16 apiece."""
    ids = torch.tensor([[6, 1]] * 40)
    w = torch.rand(40, 2, generator=torch.Generator().manual_seed(6))
    check(tokens(40, 128, torch.float32), ids, w, experts(128, 192, seed=7))


def test_a_token_sums_its_own_experts_outputs():
    """One token on two experts whose outputs differ (expert 5's blocks scaled 16x expert 2's
    and negated): the sum weighs each expert's output by its own weight, so swapping the two
    experts between the slots changes it, and each order equals the loop."""
    ex = experts(128, 64, seed=8)
    gate_up, gate_up_scale, down, down_scale = (t.clone() for t in ex)
    gate_up[5], gate_up_scale[5] = gate_up[2], gate_up_scale[2]
    down[5], down_scale[5] = (-down[2].float()).to(fp8_blocks.FP8_DTYPE), down_scale[2] * 16
    ex = Experts(gate_up, gate_up_scale, down, down_scale)
    x = tokens(1, 128, torch.float32, seed=9)
    w = torch.tensor([[0.75, 0.25]])
    a = torch.tensor([[2, 5]])
    b = torch.tensor([[5, 2]])
    check(x, a, w, ex)
    check(x, b, w, ex)
    alone = [fused(x.to(DEVICE), torch.tensor([[e]]).to(DEVICE), torch.ones(1, 1).to(DEVICE), ex)
             for e in (2, 5)]  # fmt: skip
    assert torch.allclose(alone[1], -16 * alone[0], rtol=1e-5, atol=0)  # the outputs differ
    ab, ba = (fused(x.to(DEVICE), i.to(DEVICE), w.to(DEVICE), ex) for i in (a, b))
    assert torch.allclose(ab, 0.75 * alone[0] + 0.25 * alone[1], rtol=1e-5, atol=1e-6)
    assert (ab - ba).abs().max() > 0.5 * ab.abs().max()


# ---------------------------------------------------------------- operands and blocks


def test_mismatched_fp8_operands_are_refused():
    ex = experts(128, 64)
    x = tokens(2, 128, torch.float32).to(DEVICE)
    ids, w = (t.to(DEVICE) for t in routing(2))
    gus, ds = ex.gate_up_scale, ex.down_scale
    refused = [
        (ex.gate_up, ex.down, gus, None),  # one scale only
        (ex.gate_up, ex.down, gus.repeat(1, 2, 1), ds),  # a scale of the wrong shape
        (ex.gate_up, ex.down, gus, ds.double()),
        (ex.gate_up.float(), ex.down.float(), gus, ds),  # 16-bit weights with scales
        (ex.gate_up, ex.down, None, None),  # fp8 weights without
    ]
    for gate_up, down, gate_up_scale, down_scale in refused:
        with pytest.raises(ValueError, match="fused_moe"):
            triton_moe.fused_moe(
                x, ids, w, gate_up, down, gate_up_scale=gate_up_scale, down_scale=down_scale
            )
    with pytest.raises(ValueError, match="scale blocks"):  # K steps that are not the blocks
        triton_moe.fused_moe(
            x, ids, w, ex.gate_up, ex.down, triton_moe.Config(16, 16, 64, 4, 2),
            gate_up_scale=gus, down_scale=ds,
        )  # fmt: skip
    empty = triton_moe.fused_moe(
        x[:0], ids[:0], w[:0], ex.gate_up, ex.down, gate_up_scale=gus, down_scale=ds
    )
    assert empty.shape == (0, 128)


def test_fp8_config_rule():
    """BLOCK_K is the scale block at every N, even past a short H or I; M and N follow the
    16-bit rule; a float32 model keeps its stages (the operands are e4m3)."""
    for n in (1, 32, 512, 8192):
        fp8 = triton_moe.config_for(n, 7168, 2048, 8, 256, fp8=True)
        bf16 = triton_moe.config_for(n, 7168, 2048, 8, 256)
        assert fp8.block_k == B
        assert (fp8.block_m, fp8.block_n, fp8.num_warps) == (
            bf16.block_m,
            bf16.block_n,
            bf16.num_warps,
        )
    small = triton_moe.config_for(4, 128, 64, 2, 8, torch.float32, fp8=True)
    assert (small.block_n, small.block_k) == (32, B)
    assert small.num_stages == triton_moe.config_for(4, 128, 64, 2, 8, fp8=True).num_stages


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
def test_on_cuda_no_host_sync_and_a_cuda_graph_replays_new_routing():
    ex = experts(256, 192)
    x = tokens(9, 256, torch.bfloat16).to(DEVICE)
    ids, w = (t.to(DEVICE) for t in routing(9))
    fused(x, ids, w, ex)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused(x, ids, w, ex)  # a host sync would raise
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static_x, static_ids, static_w = x.clone(), ids.clone(), w.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused(static_x, static_ids, static_w, ex)
    for seed in (5, 6):
        new_ids, new_w = routing(9, seed=seed)
        static_x.copy_(tokens(9, 256, torch.bfloat16, seed=seed))
        static_ids.copy_(new_ids)
        static_w.copy_(new_w)
        graph.replay()
        assert torch.equal(out, fused(static_x, static_ids, static_w, ex))


@pytest.mark.parametrize("pow2", [False, True])
def test_the_models_cpu_loop_is_this_oracle(pow2: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """model/moe.py's `Experts.loop` with fp8 experts (the CPU's path) computes the oracle's
    bits, with its `fp8_pow2_scales` as the oracle's pow2, so the fused kernel held to the
    oracle is held to the model; and its forward passes the flag to the fused kernel."""
    from torch import nn

    from pdserve.model.deepseek_config import MoEArch
    from pdserve.model.moe import Experts as ModelExperts

    hidden, inter = 256, 192
    arch = MoEArch(
        num_experts=E, top_k=TOP_K, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=1.0, moe_intermediate_size=inter, n_shared_experts=0,
        first_k_dense_replace=0,
    )  # fmt: skip
    ex = experts(hidden, inter)
    model = ModelExperts(arch, hidden)
    for name, t in zip(
        ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"),
        (ex.gate_up, ex.gate_up_scale, ex.down, ex.down_scale),
        strict=True,
    ):
        setattr(model, name, nn.Parameter(t.cpu(), requires_grad=False))
    model.fp8_pow2_scales = pow2
    x = tokens(23, hidden, torch.float32)
    ids, weights = routing(23)
    on_cpu = Experts(*(t.cpu() for t in ex))
    want, _ = loop(x, ids, weights, on_cpu, pow2)
    assert torch.equal(model.loop(x, ids, weights), want)
    assert not torch.equal(loop(x, ids, weights, on_cpu, not pow2)[0], want)
    monkeypatch.setenv(ops.FUSED_MOE_ENV, "1")
    xd, idsd, wd = x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE)
    assert torch.equal(model.to(DEVICE)(xd, idsd, wd), fused(xd, idsd, wd, ex, None, pow2))
