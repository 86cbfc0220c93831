"""DeepSeek-V3's routed experts on the GPU: two grouped GEMMs over the assignments sorted by
expert (kernels/moe_align.py), then each token's top_k results summed in a fixed order.

The torch path (model/moe.py `Experts.loop`) reads on the host which experts were chosen and
runs one pair of products per expert: a host sync per layer, one launch per expert, and no
CUDA graph. Here the whole layer is four launches whose shapes depend only on (N, top_k, E):

  1. `align`: the assignments (a = token * top_k + slot) grouped by expert, padded per
     expert to BLOCK_M;
  2. gate-up: one program per (block of BLOCK_M sorted assignments, BLOCK_N columns of I)
     gathers its tokens' rows of x and multiplies them by its expert's gate and up rows
     (`gate_up_proj` [E, 2I, H]), SiLU(gate) * up in the epilogue -> h [A, I];
  3. down: the same blocks multiply h by the expert's `down_proj` [E, H, I] and the
     assignment's routing weight in the epilogue -> [A, H], one row per assignment;
  4. sum: each token's top_k rows added in expert order, in one program per (token, columns):
     deterministic, no atomics.

Blocks past the padded length in use return at once; padding rows are masked. The numerics
are the torch path's: products accumulate in float32 and are rounded to the model's dtype,
silu is rounded before the multiply, the weight multiplies in float32 and rounds, and each
token's sum adds its experts' outputs in expert index order, rounding after each add (HF's
`index_add_` loop). float32 operands multiply exactly ("ieee", never TF32), so a float32
model keeps its greedy parity with HF. Under Triton's CPU interpreter (the tests) bfloat16
operands are multiplied in float32, since numpy has no bfloat16.

Experts stored as block-quantised fp8 (e4m3 weights with float32 block scales, DeepSeek's
checkpoints) take the same align and sum around fp8 GEMMs of their own, with the activations
quantised per token per group of 128 (kernels/triton_moe_fp8.py).

`config_for` is the block rule: BLOCK_M follows the assignments an expert can expect (few
in decode: small blocks, one weight pass; many in prefill: larger blocks reuse each weight
tile across more rows), sized so a stage's tiles fit in shared memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pdserve.kernels import triton_moe_fp8
from pdserve.kernels.moe_align import Alignment, align, block_of
from pdserve.kernels.moe_config import Config, config_for
from pdserve.kernels.pdl import enter, launch
from pdserve.kernels.triton_fused import silu_mul_tile

SUM_BLOCK = 1024  # columns a program of the sum kernel adds


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [N, H]
    w_ptr,  # [E, 2I, H]: gate rows, then up rows
    h_ptr,  # [A, I] out: silu(gate) * up, a row per assignment
    sorted_ptr,
    block_expert_ptr,
    total_ptr,
    A,
    H,
    INTER,
    stride_xn,
    stride_we,
    stride_wn,
    stride_hm,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,  # the operands' dtype in tl.dot
    PRECISION: tl.constexpr,  # tl.dot's input_precision ("ieee" for float32)
    PDL: tl.constexpr,
):
    enter(PDL, True)
    if tl.program_id(0) * BLOCK_M >= tl.load(total_ptr):
        return
    a, real, expert = block_of(sorted_ptr, block_expert_ptr, A, BLOCK_M)
    token = (a // TOP_K).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xn + rk[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs = w_ptr + expert * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    u_ptrs = g_ptrs + INTER * stride_wn  # [BLOCK_K, BLOCK_N]: w[e, INTER + n, k]
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kmask = k0 + rk < H
        x = tl.load(x_ptrs + k0, mask=real[:, None] & kmask[None, :], other=0.0).to(DOT)
        wmask = kmask[:, None] & (rn < INTER)[None, :]
        wg = tl.load(g_ptrs + k0, mask=wmask, other=0.0).to(DOT)
        wu = tl.load(u_ptrs + k0, mask=wmask, other=0.0).to(DOT)
        gate = tl.dot(x, wg, gate, input_precision=PRECISION)
        up = tl.dot(x, wu, up, input_precision=PRECISION)
    # rounded as the torch path rounds: each product to the dtype, silu, then times up
    dt = h_ptr.dtype.element_ty
    h = silu_mul_tile(gate.to(dt), up.to(dt))
    h_ptrs = h_ptr + a[:, None].to(tl.int64) * stride_hm + rn[None, :]
    tl.store(h_ptrs, h, mask=real[:, None] & (rn < INTER)[None, :])


@triton.jit
def _down_kernel(
    h_ptr,  # [A, I]
    w_ptr,  # [E, H, I]
    weights_ptr,  # [A] float32: each assignment's routing weight
    out_ptr,  # [A, H] out: weight * (h @ down_proj[e].T), a row per assignment
    sorted_ptr,
    block_expert_ptr,
    total_ptr,
    A,
    H,
    INTER,
    stride_hm,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
    rk = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None] * stride_hm + rk[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + expert * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        kmask = k0 + rk < INTER
        h = tl.load(h_ptrs + k0, mask=real[:, None] & kmask[None, :], other=0.0).to(DOT)
        w = tl.load(w_ptrs + k0, mask=kmask[:, None] & (rn < H)[None, :], other=0.0).to(DOT)
        acc = tl.dot(h, w, acc, input_precision=PRECISION)
    dt = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + rows, mask=real, other=0.0)
    y = (acc.to(dt).to(tl.float32) * weight[:, None]).to(dt)  # the product rounded, then weighed
    out_ptrs = out_ptr + rows[:, None] * stride_om + rn[None, :]
    tl.store(out_ptrs, y, mask=real[:, None] & (rn < H)[None, :])


@triton.jit
def _sum_kernel(
    per_slot_ptr,  # [N * TOP_K, H]
    ids_ptr,  # [N, TOP_K]: each token's experts, distinct; E or more: nobody's, skipped
    out_ptr,  # [N, H]
    H,
    E,
    stride_pm,
    stride_on,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,  # TOP_K rounded up to a power of two
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, True)
    t = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, SLOTS)
    ids = tl.load(ids_ptr + t * TOP_K + slots, mask=slots < TOP_K, other=2**30).to(tl.int32)
    # each slot's place in expert order (the unused slots come last: their id is the largest;
    # equal ids, nobody's, in slot order)
    before = (ids[None, :] < ids[:, None]) | (
        (ids[None, :] == ids[:, None]) & (slots[None, :] < slots[:, None])
    )
    rank = tl.sum(before.to(tl.int32), axis=1)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < H
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tl.sum(tl.where(rank == j, slots, 0))
        ours = tl.sum(tl.where(rank == j, ids, 0)) < E  # (a skipped slot's row was never written)
        at = per_slot_ptr + (t * TOP_K + slot) * stride_pm + cols
        row = tl.load(at, mask=cmask & ours, other=0.0)  # adding 0 leaves acc as it was
        acc = (acc + row.to(tl.float32)).to(dt).to(tl.float32)  # each add rounded, as index_add_
    tl.store(out_ptr + t * stride_on + cols, acc.to(dt), mask=cmask)


def _dot(dtype: torch.dtype, kernel: object) -> tuple[tl.dtype, str]:
    """tl.dot's operand dtype and input_precision for a model of `dtype`."""
    if dtype == torch.float32 or isinstance(kernel, InterpretedFunction):
        return tl.float32, "ieee"  # numpy has no bfloat16: the interpreter multiplies float32
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), "tf32"  # (unused for 16-bit)


def fused_moe(
    x: torch.Tensor,  # [N, H]
    ids: torch.Tensor,  # [N, top_k] int: each token's experts, distinct (E or more: skipped)
    weights: torch.Tensor,  # [N, top_k] float32: their routing weights
    gate_up_proj: torch.Tensor,  # [E, 2I, H]: x's dtype, or e4m3 with gate_up_scale
    down_proj: torch.Tensor,  # [E, H, I]: x's dtype, or e4m3 with down_scale
    config: Config | None = None,
    *,
    gate_up_scale: torch.Tensor | None = None,  # [E, ceil(2I / 128), ceil(H / 128)] float32
    down_scale: torch.Tensor | None = None,  # [E, ceil(H / 128), ceil(I / 128)] float32
    pow2: bool = False,  # fp8 experts: activation scales rounded up to powers of two
) -> torch.Tensor:  # [N, H], x's dtype
    """sum over each token's top_k experts e of weight * down_e(silu(gate_e(x)) * up_e(x)),
    as model/moe.py's loop computes it, with no host synchronisation. With both scales the
    experts are block-quantised fp8 and multiply as kernels/fp8_blocks.py's reference does
    (x and h quantised per token per group of 128, their scales powers of two with `pow2`:
    kernels/triton_moe_fp8.py); 16-bit experts quantise nothing, so `pow2` is moot there."""
    n, hidden = x.shape
    e, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    fp8 = gate_up_scale is not None or down_scale is not None
    if fp8:
        weights_ok = triton_moe_fp8.scales_fit(gate_up_proj, gate_up_scale, down_proj, down_scale)
    else:
        weights_ok = gate_up_proj.dtype == down_proj.dtype == x.dtype
    if (
        not weights_ok
        or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)
        or gate_up_proj.shape != (e, 2 * inter, hidden)
        or down_proj.shape != (e, hidden, inter)
        or ids.shape != weights.shape
        or ids.shape[0] != n
        or not all(t.stride(-1) == 1 for t in (x, gate_up_proj, down_proj))
    ):
        scales = [
            None if t is None else (tuple(t.shape), t.dtype) for t in (gate_up_scale, down_scale)
        ]
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)} {x.dtype}, ids {tuple(ids.shape)}, weights "
            f"{tuple(weights.shape)}, gate_up_proj {tuple(gate_up_proj.shape)} "
            f"{gate_up_proj.dtype}, down_proj {tuple(down_proj.shape)} {down_proj.dtype}, "
            f"scales {scales}: wants [N, H], [N, K], [N, K], [E, 2I, H], [E, H, I] of one float "
            "dtype, unit stride in H/I; or those weights in float8_e4m3fn with both float32 "
            "scales, [E, ceil(2I/128), ceil(H/128)] and [E, ceil(H/128), ceil(I/128)]"
        )
    top_k = ids.shape[1]
    if n == 0:
        return torch.zeros_like(x)
    cfg = config or config_for(n, hidden, inter, top_k, e, x.dtype, fp8)
    if fp8 and cfg.block_k != triton_moe_fp8.GROUP:
        raise ValueError(f"fused_moe: fp8 experts step K by scale blocks of 128, not {cfg}")
    ids = ids.contiguous()
    layout = align(ids, e, cfg.block_m)
    flat_weights = weights.float().reshape(-1).contiguous()  # [A]
    if gate_up_scale is not None and down_scale is not None:
        per_slot = triton_moe_fp8.routed(
            x, flat_weights, layout, top_k, gate_up_proj, gate_up_scale, down_proj,
            down_scale, cfg, pow2,
        )  # fmt: skip
    else:
        per_slot = _routed(x, flat_weights, layout, top_k, gate_up_proj, down_proj, cfg)
    return _sum(per_slot, ids, e)


def _routed(
    x: torch.Tensor,  # [N, H]
    weights: torch.Tensor,  # [A] float32
    layout: Alignment,
    top_k: int,
    gate_up_proj: torch.Tensor,  # [E, 2I, H], x's dtype
    down_proj: torch.Tensor,  # [E, H, I], x's dtype
    cfg: Config,
) -> torch.Tensor:  # [A, H]: each assignment's weighted expert output
    """The 16-bit (and float32) experts: steps 2 and 3 of the module docstring."""
    num, (_, hidden), inter = weights.numel(), x.shape, down_proj.shape[-1]
    blocks = layout.block_expert.numel()
    dot, precision = _dot(x.dtype, _gate_up_kernel)
    common = dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT=dot,
        PRECISION=precision,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    h = torch.empty((num, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks, triton.cdiv(inter, cfg.block_n))](
        x,
        gate_up_proj,
        h,
        layout.sorted_ids,
        layout.block_expert,
        layout.total,
        num,
        hidden,
        inter,
        x.stride(0),
        gate_up_proj.stride(0),
        gate_up_proj.stride(1),
        h.stride(0),
        TOP_K=top_k,
        **common,
        **launch(x.device, _gate_up_kernel),
    )
    per_slot = torch.empty((num, hidden), dtype=x.dtype, device=x.device)
    _down_kernel[(blocks, triton.cdiv(hidden, cfg.block_n))](
        h,
        down_proj,
        weights,
        per_slot,
        layout.sorted_ids,
        layout.block_expert,
        layout.total,
        num,
        hidden,
        inter,
        h.stride(0),
        down_proj.stride(0),
        down_proj.stride(1),
        per_slot.stride(0),
        **common,
        **launch(x.device, _down_kernel),
    )
    return per_slot


def _sum(per_slot: torch.Tensor, ids: torch.Tensor, experts: int) -> torch.Tensor:
    """per_slot [N * top_k, H] -> [N, H]: each token's rows added in expert order (step 4),
    slots of ids `experts` or more (nobody's) left out."""
    n, top_k = ids.shape
    hidden = per_slot.shape[1]
    out = torch.empty((n, hidden), dtype=per_slot.dtype, device=per_slot.device)
    block = min(SUM_BLOCK, triton.next_power_of_2(hidden))
    _sum_kernel[(n, triton.cdiv(hidden, block))](
        per_slot,
        ids,
        out,
        hidden,
        experts,
        per_slot.stride(0),
        out.stride(0),
        TOP_K=top_k,
        SLOTS=triton.next_power_of_2(top_k),
        BLOCK=block,
        **launch(per_slot.device, _sum_kernel),
    )
    return out
