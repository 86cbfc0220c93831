"""The fused mixture of experts' fp8 products: experts stored as DeepSeek's block-quantised fp8
(kernels/fp8_blocks.py: e4m3 weights, one float32 scale per 128 x 128 block) multiplied as
DeepSeek's own inference multiplies them, with activations quantised per token per group of
128. kernels/triton_moe.py aligns the assignments, calls `routed` in place of its 16-bit
GEMMs, and sums each token's rows as for any dtype.

  1. x [N, H] is quantised once (`act_quant`): every expert a token goes to reads the same
     e4m3 row and group scales;
  2. gate-up: a program's tokens' rows times its expert's gate and up rows, one K block of 128
     at a time: each block's dot (exact e4m3 products, summed in float32) is scaled by the
     row's activation scale and each output column's weight scale and added into a float32
     accumulator; the epilogue rounds as the 16-bit kernel's (the products to the model's
     dtype, silu, times up) -> h [A, I] in the model's dtype;
  3. h is quantised per assignment per group of 128 (`act_quant`, the same call as x's);
     with `pow2` (ue8m0 checkpoints) both x's and h's scales are rounded up to powers of two;
  4. down: h's e4m3 rows times the expert's down rows, scaled the same way, the product
     rounded to the model's dtype and then weighed by the routing weight -> [A, H].

Scales. A K block is a scale block (BLOCK_K = 128), so one activation scale per row and one
weight scale per column cover a whole block's dot. A column's weight scale is its weight row
// 128, looked up per column: gate row j and up row I + j of `gate_up_proj` can lie in
different scale blocks (I need not be a multiple of 128: the tiny model's is 64), and a tile of
BLOCK_N columns can straddle a block boundary.

Each K block's dot starts from zero and is promoted to the float32 accumulator after its 128
products: Hopper's fp8 MMA accumulates with fewer bits than float32 (DeepSeek-V3 promotes
every 128 for the same reason), and the block's scales can only be applied between dots.

Why h is quantised by a pass of its own rather than in the gate-up epilogue: the epilogue
would need each program to own whole groups of 128 columns of I, forcing BLOCK_N = 128. In
decode, the time that matters, the products are a stream of expert weights, and BLOCK_N 32
runs four times as many programs over them as 128 would; the pass costs h's bytes twice
(A x I, under 1% of the expert bytes at every N of benchmarks/kernels/moe.py --fp8) and
one launch, and x and h then share one quantiser with one rounding, swappable in one place.

On the GPU tl.dot takes the e4m3 tiles as they are, with a float32 result (Hopper's fp8
MMA); under Triton's CPU interpreter (numpy has no fp8) they are converted to float32 first,
which is exact, and multiplied in "ieee" float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pdserve.kernels import fp8_blocks, triton_fp8
from pdserve.kernels.moe_align import Alignment, block_of
from pdserve.kernels.pdl import enter, launch
from pdserve.kernels.triton_fused import silu_mul_tile

if TYPE_CHECKING:
    from pdserve.kernels.moe_config import Config

GROUP = fp8_blocks.BLOCK  # the weight's scale block, the activations' group, and BLOCK_K


def act_quant(x: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] in the model's dtype -> (e4m3 [R, K], float32 scales [R, ceil(K / 128)], powers
    of two with `pow2`): the one place this module quantises activations (x and h), with
    kernels/triton_fp8.py's kernel (fp8_blocks.act_quant's bits, one launch)."""
    return triton_fp8.act_quant(x.contiguous(), pow2)


def scales_fit(
    gate_up_proj: torch.Tensor,  # [E, 2I, H] e4m3
    gate_up_scale: torch.Tensor | None,  # [E, ceil(2I / 128), ceil(H / 128)] float32
    down_proj: torch.Tensor,  # [E, H, I] e4m3
    down_scale: torch.Tensor | None,  # [E, ceil(H / 128), ceil(I / 128)] float32
) -> bool:
    """Whether both weights are e4m3 with float32 block scales of their shapes, unit stride
    along the scales' last side (the kernels step along it one K block at a time)."""
    if gate_up_scale is None or down_scale is None:
        return False
    e, two_i, hidden = gate_up_proj.shape
    inter = down_proj.shape[-1]

    def blocks(n: int) -> int:
        return -(-n // GROUP)

    return (
        gate_up_proj.dtype == down_proj.dtype == fp8_blocks.FP8_DTYPE
        and gate_up_scale.dtype == down_scale.dtype == torch.float32
        and gate_up_scale.shape == (e, blocks(two_i), blocks(hidden))
        and down_scale.shape == (e, blocks(hidden), blocks(inter))
        and gate_up_scale.stride(-1) == down_scale.stride(-1) == 1
    )


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [N, H] e4m3: the tokens, quantised
    xs_ptr,  # [N, ceil(H / GROUP)] float32: their group scales
    w_ptr,  # [E, 2I, H] e4m3: gate rows, then up rows
    ws_ptr,  # [E, ceil(2I / GROUP), ceil(H / GROUP)] float32: its block scales
    h_ptr,  # [A, I] out, the model's dtype: silu(gate) * up, a row per assignment
    sorted_ptr,
    block_expert_ptr,
    total_ptr,
    A,
    H,
    INTER,
    stride_xn,
    stride_xsn,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_hm,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,  # BLOCK_K: one scale block
    DOT: tl.constexpr,  # the operands' dtype in tl.dot (e4m3 compiled, float32 interpreted)
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, True)
    if tl.program_id(0) * BLOCK_M >= tl.load(total_ptr):
        return
    a, real, expert = block_of(sorted_ptr, block_expert_ptr, A, BLOCK_M)
    token = (a // TOP_K).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < INTER
    rk = tl.arange(0, GROUP)
    x_ptrs = x_ptr + token[:, None] * stride_xn + rk[None, :]  # [BLOCK_M, GROUP]
    xs_ptrs = xs_ptr + token * stride_xsn  # [BLOCK_M]
    g_ptrs = w_ptr + expert * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    u_ptrs = g_ptrs + INTER * stride_wn  # [GROUP, BLOCK_N]: w[e, INTER + n, k]
    # each column's scale row: gate row n is in block n // GROUP, up row INTER + n in its own
    gs_ptrs = ws_ptr + expert * stride_se + (rn // GROUP) * stride_sn  # [BLOCK_N]
    us_ptrs = ws_ptr + expert * stride_se + ((INTER + rn) // GROUP) * stride_sn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(H, GROUP)):
        k0 = kb * GROUP
        kmask = k0 + rk < H
        x = tl.load(x_ptrs + k0, mask=real[:, None] & kmask[None, :], other=0.0).to(DOT)
        wmask = kmask[:, None] & nmask[None, :]
        wg = tl.load(g_ptrs + k0, mask=wmask, other=0.0).to(DOT)
        wu = tl.load(u_ptrs + k0, mask=wmask, other=0.0).to(DOT)
        xs = tl.load(xs_ptrs + kb, mask=real, other=0.0)[:, None]
        gs = tl.load(gs_ptrs + kb, mask=nmask, other=0.0)[None, :]
        us = tl.load(us_ptrs + kb, mask=nmask, other=0.0)[None, :]
        # the block's own dot, then scaled as fp8_blocks.block_linear scales it
        gate += tl.dot(x, wg, input_precision=PRECISION) * xs * gs
        up += tl.dot(x, wu, input_precision=PRECISION) * xs * us
    dt = h_ptr.dtype.element_ty
    h = silu_mul_tile(gate.to(dt), up.to(dt))  # the products rounded, silu, then times up
    h_ptrs = h_ptr + a[:, None].to(tl.int64) * stride_hm + rn[None, :]
    tl.store(h_ptrs, h, mask=real[:, None] & nmask[None, :])


@triton.jit
def _down_kernel(
    h_ptr,  # [A, I] e4m3: silu(gate) * up, quantised
    hs_ptr,  # [A, ceil(I / GROUP)] float32: its group scales
    w_ptr,  # [E, H, I] e4m3
    ws_ptr,  # [E, ceil(H / GROUP), ceil(I / GROUP)] float32
    weights_ptr,  # [A] float32: each assignment's routing weight
    out_ptr,  # [A, H] out, the model's dtype: weight * (h @ down_proj[e].T)
    sorted_ptr,
    block_expert_ptr,
    total_ptr,
    A,
    H,
    INTER,
    stride_hm,
    stride_hsm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, True)
    if tl.program_id(0) * BLOCK_M >= tl.load(total_ptr):
        return
    a, real, expert = block_of(sorted_ptr, block_expert_ptr, A, BLOCK_M)
    rows = a.to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < H
    rk = tl.arange(0, GROUP)
    h_ptrs = h_ptr + rows[:, None] * stride_hm + rk[None, :]  # [BLOCK_M, GROUP]
    hs_ptrs = hs_ptr + rows * stride_hsm
    w_ptrs = w_ptr + expert * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    ws_ptrs = ws_ptr + expert * stride_se + (rn // GROUP) * stride_sn  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(INTER, GROUP)):
        k0 = kb * GROUP
        kmask = k0 + rk < INTER
        h = tl.load(h_ptrs + k0, mask=real[:, None] & kmask[None, :], other=0.0).to(DOT)
        w = tl.load(w_ptrs + k0, mask=kmask[:, None] & nmask[None, :], other=0.0).to(DOT)
        hs = tl.load(hs_ptrs + kb, mask=real, other=0.0)[:, None]
        ws = tl.load(ws_ptrs + kb, mask=nmask, other=0.0)[None, :]
        acc += tl.dot(h, w, input_precision=PRECISION) * hs * ws
    dt = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + rows, mask=real, other=0.0)
    y = (acc.to(dt).to(tl.float32) * weight[:, None]).to(dt)  # the product rounded, then weighed
    tl.store(
        out_ptr + rows[:, None] * stride_om + rn[None, :], y, mask=real[:, None] & nmask[None, :]
    )


def _dot(kernel: object) -> tuple[tl.dtype, str]:
    """tl.dot's operand dtype and input_precision: e4m3 on the GPU (the precision is unused),
    float32 multiplied exactly under the interpreter."""
    if isinstance(kernel, InterpretedFunction):
        return tl.float32, "ieee"
    return tl.float8e4nv, "tf32"


def routed(
    x: torch.Tensor,  # [N, H], the model's dtype
    weights: torch.Tensor,  # [A] float32: each assignment's routing weight
    layout: Alignment,  # the assignments sorted by expert, padded to cfg.block_m
    top_k: int,
    gate_up_proj: torch.Tensor,  # [E, 2I, H] e4m3
    gate_up_scale: torch.Tensor,  # [E, ceil(2I / 128), ceil(H / 128)] float32
    down_proj: torch.Tensor,  # [E, H, I] e4m3
    down_scale: torch.Tensor,  # [E, ceil(H / 128), ceil(I / 128)] float32
    cfg: Config,  # block_k == GROUP
    pow2: bool = False,  # x's and h's scales rounded up to powers of two
) -> torch.Tensor:  # [A, H], x's dtype: each assignment's weighted expert output
    """Steps 1-4 of the module docstring, for operands kernels/triton_moe.fused_moe checked."""
    num, (_, hidden), inter = weights.numel(), x.shape, down_proj.shape[-1]
    blocks = layout.block_expert.numel()
    dot, precision = _dot(_gate_up_kernel)
    common = dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        GROUP=GROUP,
        DOT=dot,
        PRECISION=precision,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    xq, xs = act_quant(x, pow2)
    h = torch.empty((num, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks, triton.cdiv(inter, cfg.block_n))](
        xq,
        xs,
        gate_up_proj,
        gate_up_scale,
        h,
        layout.sorted_ids,
        layout.block_expert,
        layout.total,
        num,
        hidden,
        inter,
        xq.stride(0),
        xs.stride(0),
        gate_up_proj.stride(0),
        gate_up_proj.stride(1),
        gate_up_scale.stride(0),
        gate_up_scale.stride(1),
        h.stride(0),
        TOP_K=top_k,
        **common,
        **launch(x.device, _gate_up_kernel),
    )
    hq, hs = act_quant(h, pow2)
    per_slot = torch.empty((num, hidden), dtype=x.dtype, device=x.device)
    _down_kernel[(blocks, triton.cdiv(hidden, cfg.block_n))](
        hq,
        hs,
        down_proj,
        down_scale,
        weights,
        per_slot,
        layout.sorted_ids,
        layout.block_expert,
        layout.total,
        num,
        hidden,
        inter,
        hq.stride(0),
        hs.stride(0),
        down_proj.stride(0),
        down_proj.stride(1),
        down_scale.stride(0),
        down_scale.stride(1),
        per_slot.stride(0),
        **common,
        **launch(x.device, _down_kernel),
    )
    return per_slot
