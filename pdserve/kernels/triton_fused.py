"""Triton kernels for the fused ops (kernels/ops.py dispatches CUDA tensors here).

A decode step of a small model is launch-bound even as a CUDA graph: each kernel costs a few
microseconds however little it does. Unfused, a Llama layer ran ~40 kernels (RMSNorm alone is
six: cast, square, mean, rsqrt, multiply, scale); these three kernels, with the fused QKV and
gate-up matmuls, bring it to about ten.

* `rms_norm` / `add_rms_norm`: one program per row; with a residual, the sum is stored (in the
  residual's dtype, rounded as torch's add would) and normalised in one pass.
* `silu_mul`: one program per (row, block of columns) of [N, 2I] -> [N, I].
* `rotary`: one program per token rotates every query and key head in place, computing
  cos/sin from the position and inv_freq in float32 (no table to keep).

Numerics follow kernels/reference.py: float32 inside, rounded to the tensor's dtype where the
reference rounds, except the float32 rotation, which is one explicit fused multiply-add
(`rope_halves`: the same bits in every kernel that rotates, within one float32 rounding of the
reference's). Under TRITON_INTERPRET=1 they run on CPU tensors (the CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.pdl import enter, launch


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    out_ptr,
    w_ptr,
    x_stride,
    res_stride,
    out_stride,
    D,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, True)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # the sum, rounded as torch does
        tl.store(res_ptr + row * res_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    var = tl.sum(x32 * x32, axis=0) / D
    normed = (x32 * tl.math.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + cols, y, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """[N, D] rows with unit stride along D. With `residual` ([N, D], contiguous rows), it is
    updated in place to x + residual and the norm is of that sum."""
    n, d = x.shape
    out = torch.empty((n, d), dtype=torch.result_type(weight, x), device=x.device)
    if n == 0:
        return out
    res = residual if residual is not None else x
    _rms_norm_kernel[(n,)](
        x,
        res,
        out,
        weight,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        d,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(d),
        **launch(x.device, _rms_norm_kernel),
    )
    return out


@triton.jit
def silu_mul_tile(gate, up):
    """silu(gate) * up for tiles of the model's dtype, rounded as reference.silu_mul rounds:
    F.silu to the dtype, then the product to the dtype (the fused MoE's epilogues use it too)."""
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_mul_kernel(
    x_ptr, out_ptr, x_stride, out_stride, inter, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    enter(PDL, True)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * out_stride + cols, silu_mul_tile(gate, up), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate then up, unit stride along columns) -> [N, I]."""
    n, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    if n == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        inter,
        BLOCK=block,
        **launch(gate_up.device, _silu_mul_kernel),
    )
    return out


@triton.jit
def rotate_heads(
    base,
    head_stride,
    n_heads,
    freq,
    imask,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < n_heads) & imask[None, :]
    lo_ptr = base + heads[:, None] * head_stride + i[None, :]
    x1 = tl.load(lo_ptr, mask=mask, other=0.0)
    x2 = tl.load(lo_ptr + HALF, mask=mask, other=0.0)
    y1, y2 = rope_halves(x1, x2, freq)
    tl.store(lo_ptr, y1, mask=mask)
    tl.store(lo_ptr + HALF, y2, mask=mask)


@triton.jit
def rope_halves(x1, x2, freq):
    """The rotated halves (y1, y2) of heads whose halves are x1, x2 ([H, D/2], the tensor's
    dtype), by angles `freq` ([D/2] float32: position * inv_freq)."""
    cos = tl.cos(freq).to(x1.dtype).to(tl.float32)[None, :]  # the reference's .to(q.dtype)
    sin = tl.sin(freq).to(x1.dtype).to(tl.float32)[None, :]
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # out = x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1).
    if x1.dtype == tl.float32:
        # No rounding step separates the products from the sum here, so the compiler may
        # contract either product into a fused multiply-add, and differently in different
        # kernels (a three-program variant of rope_store_kv differed from rotary in the last
        # bit: benchmarks/RESULTS.md, 2026-12-02). One explicit FMA fixes the order:
        # y1 = round(a1 * cos + round(-a2 * sin)), the same bits in every kernel that calls this.
        y1 = tl.fma(a1, cos, -a2 * sin)
        y2 = tl.fma(a2, cos, a1 * sin)
    else:
        # each product is rounded to the dtype before the sum, as the reference's separate
        # ops are. (Compiled, this form's bits are still the compiler's to keep: in the
        # three-program variant y2 came out one bf16 step off rotary's, so rope_store_kv
        # stays one program a token; tests/attention/test_triton_rope_store.py checks it.)
        y1 = (a1 * cos).to(x1.dtype).to(tl.float32) + (-a2 * sin).to(x1.dtype).to(tl.float32)
        y2 = (a2 * cos).to(x1.dtype).to(tl.float32) + (a1 * sin).to(x1.dtype).to(tl.float32)
    return y1.to(x1.dtype), y2.to(x1.dtype)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    inv_freq_ptr,
    q_tok_stride,
    q_head_stride,
    k_tok_stride,
    k_head_stride,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, True)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.float32)
    i = tl.arange(0, BLOCK_HALF)
    imask = i < HALF
    freq = pos * tl.load(inv_freq_ptr + i, mask=imask, other=0.0)
    rotate_heads(
        q_ptr + tok * q_tok_stride, q_head_stride, HQ, freq, imask, HALF, BLOCK_H, BLOCK_HALF
    )
    rotate_heads(
        k_ptr + tok * k_tok_stride, k_head_stride, HKV, freq, imask, HALF, BLOCK_H, BLOCK_HALF
    )


def rotary(
    q: torch.Tensor,  # [T, Hq, D], unit stride along D
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T]
    inv_freq: torch.Tensor,  # [D/2] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place (they may be views of one fused QKV output) and returns them."""
    t, hq, d = q.shape
    if t == 0:
        return q, k
    hkv = k.shape[1]
    _rotary_kernel[(t,)](
        q,
        k,
        positions,
        inv_freq,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        HQ=hq,
        HKV=hkv,
        HALF=d // 2,
        BLOCK_H=triton.next_power_of_2(max(hq, hkv)),
        BLOCK_HALF=triton.next_power_of_2(d // 2),
        **launch(q.device, _rotary_kernel),
    )
    return q, k
