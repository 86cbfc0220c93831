"""DeepSeek's fp8 block-scaled products on the GPU: the activation quantised per group of 128,
then a GEMM whose fp8 operands go to the tensor cores as they are stored. The format and the
torch reference it equals are kernels/fp8_blocks.py.

`act_quant`: one program per (row, GROUPS groups of 128 columns). Each group's scale is
max|x| clamped to MIN_AMAX, over FP8_MAX (with POW2, rounded up to a power of two by its bits,
as fp8_blocks.pow2_ceil), and x / scale is rounded to e4m3, as the reference does, bit for bit:
both divides are IEEE (`tl.div_rn`: Triton's `/` on float32 compiles to an approximate divide),
and the rounding to e4m3 (nearest, ties to even, e4m3's subnormals below 2**-6) is done in
float32 by `_round_e4m3`, so the cast to fp8 that follows is exact.
Done so because the interpreter's float32 -> fp8 cast does not round to nearest even; on the
GPU the cast of an already rounded value is exact too, so the tests check the path that runs.

`block_linear`: one program per (BLOCK_M rows, BLOCK_N outputs, K split), the row blocks
fastest so the programs that share a weight tile run together (x is small and stays in L2;
each weight tile is read from HBM about once). It walks K one 128-column block at a time: a
tl.dot of the fp8 tiles into a fresh float32 product, scaled by the rows' activation scales
and the tile's one weight scale and added to the float32 accumulator: DeepSeek's recipe, the
reference's order of K blocks (within a block the tensor cores sum in their own order, so
results agree to float32 rounding under the interpreter, and to fp8 tensor-core accumulation
on a GPU). Invariants the indexing relies on: BLOCK_K is the scale block (128), so a K step
reads one activation scale per row and one weight scale per output block; BLOCK_N divides 128,
so a tile's outputs lie in one weight-scale row. The weight tile is loaded [BLOCK_K, BLOCK_N]
out of the [O, K] row-major weight: K-major, the layout Hopper's fp8 MMA wants for its B
operand. Ragged N, O and K (the last K block cut short) are masked; masked loads read zeros.

Split K (`Config.split_k` > 1), for decode on a narrow weight (kv_a: 576 outputs are 36
programs of 16, too few loads in flight to stream the weight at the copy rate): each split
sums a run of K blocks into a float32 partial [S, N, O], and `_sum_splits` adds the S
partials in split order and rounds once. No atomics: the result does not depend on timing.

Both launch on shapes alone (no host read, CUDA-graph capturable) and through kernels/pdl.py.
Under Triton's CPU interpreter (the tests) tl.dot takes float32 copies of the fp8 tiles,
since numpy has no fp8; the products are exact either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pdserve.kernels import fp8_blocks
from pdserve.kernels.pdl import enter, launch

BLOCK_K = fp8_blocks.BLOCK  # one activation and one weight scale per K step
QUANT_GROUPS = 8  # groups of 128 an act_quant program quantises: 1,024 columns
TARGET_PROGRAMS = 264  # two per SM of an H100 (132): config_for narrows tiles to reach it
MIN_SPLIT_BLOCKS = 4  # K blocks a split runs at least: enough steps for the loads' pipeline
SUM_BLOCK = 1024  # outputs a _sum_splits program adds
IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_MAX = tl.constexpr(fp8_blocks.FP8_MAX)
_MIN_AMAX = tl.constexpr(fp8_blocks.MIN_AMAX)
_E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
_ROUNDER = tl.constexpr(1.5 * 2.0**20)  # 2**E times this has a float32 ulp of e4m3's at 2**E
_MANTISSA_BITS = tl.constexpr(fp8_blocks.MANTISSA_BITS)
_EXPONENT_BITS = tl.constexpr(fp8_blocks.EXPONENT_BITS)
_EXPONENT_ONE = tl.constexpr(fp8_blocks.EXPONENT_ONE)


@dataclass(frozen=True)
class Config:
    block_m: int  # rows (tokens) per program
    block_n: int  # outputs per program: divides BLOCK_K, so one weight scale per K step
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs a product's K blocks are split over (at most the K blocks)

    def __post_init__(self) -> None:
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m must be a power of two >= 16, got {self.block_m}")
        if self.block_n < 16 or BLOCK_K % self.block_n:
            raise ValueError(f"block_n must divide {BLOCK_K} and be >= 16, got {self.block_n}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")


def narrowest(m: int, bn: int) -> int:
    """The narrowest BLOCK_N for m rows: every program of a column of tiles reads all m rows of
    x over K, so n / BLOCK_N programs read x that many times; at 2 * rows wide (at least 16)
    x's reads stay at most half the weight's. At a decode of a few rows that is 16 (x is a
    sliver); from 32 rows on 64 (split K fills the grid then). Measured on an H100 (RESULTS.md,
    2026-12-07 (d)): with 16 at 32 and 128 rows, o_proj and the dense down ran at 0.55-0.69x
    of bf16 cuBLAS, 1.5-1.65x at 32 rows with 64; at 128 rows, 128 (not 64) took q_b (K 1536,
    too short to split) from 27 to 42 µs."""
    return min(bn, max(16, 2 * triton.next_power_of_2(min(m, 32))))


def config_for(m: int, n: int, k: int) -> Config:
    """The blocks for an [m, k] x [n, k].T product (n: the weight's outputs). Decode (m up to
    16, 32, 64) is a pass over the weight: the smallest BLOCK_M that holds the rows, so no
    tensor-core work is spent on padding, and more stages to keep loads in flight. Prefill
    (more rows) is compute: 128 x 128 tiles and 8 warps reuse each loaded tile the most.
    BLOCK_N then halves (down to `narrowest`) until the grid has TARGET_PROGRAMS programs,
    since a narrow weight (q_a 1536, kv_a 576 outputs) otherwise leaves most SMs idle; where
    even that is too few, K is split to make up the rest, each split at least
    MIN_SPLIT_BLOCKS K blocks. These are first choices, to be replaced by what
    `benchmarks/kernels/fp8_gemm.py --sweep` measures."""
    if m <= 16:
        bm, bn, warps, stages = 16, 64, 4, 5
    elif m <= 32:
        bm, bn, warps, stages = 32, 64, 4, 4
    elif m <= 64:
        bm, bn, warps, stages = 64, 64, 4, 4
    else:
        bm, bn, warps, stages = 128, 128, 8, 3
    while bn > narrowest(m, bn) and triton.cdiv(m, bm) * triton.cdiv(n, bn) < TARGET_PROGRAMS:
        bn //= 2
    programs = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    most = triton.cdiv(k, BLOCK_K) // MIN_SPLIT_BLOCKS
    split = max(1, min(triton.cdiv(TARGET_PROGRAMS, programs), most))
    return Config(bm, bn, warps, stages, split)


# ---------------------------------------------------------------- act_quant


@triton.jit
def _round_e4m3(v):
    """float32 v (|v| <= FP8_MAX) rounded to the nearest e4m3 value, ties to even, as float32.
    Adding c = 1.5 * 2**20 * 2**E, with 2**E the power of two at or below |v| (at least 2**-6,
    e4m3's smallest normal), lands where float32's spacing is e4m3's spacing at |v|, 2**(E-3);
    the add rounds to it (nearest, ties to even) and subtracting c is exact. The sign is put
    back by its bit, so -0.0 and small negatives that round to zero stay -0.0, as torch's."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    power = tl.maximum((bits & 0x7F800000).to(tl.float32, bitcast=True), _E4M3_MIN_NORMAL)
    c = power * _ROUNDER
    rounded = (mag + c) - c
    return (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _pow2_ceil(scale):
    """fp8_blocks.pow2_ceil: a float32 scale with mantissa bits set takes the next exponent
    and a zero mantissa; a power of two, an inf or a NaN stays."""
    bits = scale.to(tl.int32, bitcast=True)
    up = ((bits & _MANTISSA_BITS) != 0) & (bits < _EXPONENT_BITS)
    rounded = tl.where(up, (bits & _EXPONENT_BITS) + _EXPONENT_ONE, bits)
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def _act_quant_kernel(
    x_ptr,  # [N, K]
    q_ptr,  # [N, K] float8_e4m3fn out
    s_ptr,  # [N, ceil(K / 128)] float32 out
    K,
    KB,
    stride_xn,
    stride_qn,
    stride_sn,
    GROUPS: tl.constexpr,
    BLOCK: tl.constexpr,
    POW2: tl.constexpr,  # the scales rounded up to powers of two (ue8m0 checkpoints)
    PDL: tl.constexpr,
):
    enter(PDL, True)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS]
    cols = g[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [GROUPS, BLOCK]
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xn + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [GROUPS]: the masked tail reads 0, as the reference pads
    scale = tl.div_rn(tl.maximum(amax, _MIN_AMAX), _FP8_MAX)
    if POW2:
        scale = _pow2_ceil(scale)
    q = _round_e4m3(tl.div_rn(x, scale[:, None]))
    tl.store(q_ptr + row * stride_qn + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sn + g, scale, mask=g < KB)


def act_quant(x: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K] (float32/bfloat16/float16, unit stride in K) -> (float8_e4m3fn [N, K], float32
    scales [N, ceil(K / 128)], powers of two with `pow2`): fp8_blocks.act_quant's bits (as the
    CPU computes it: torch on CUDA divides by a Python scalar as a multiply by its reciprocal,
    which may move a scale's last bit)."""
    if x.dim() != 2 or x.dtype not in IN_DTYPES or x.stride(-1) != 1:
        raise ValueError(
            f"act_quant: x {tuple(x.shape)} {x.dtype} (stride {x.stride()}): wants [N, K] of "
            "float32, bfloat16 or float16 with unit stride in K"
        )
    n, k = x.shape
    kb = triton.cdiv(k, BLOCK_K)
    q = torch.empty((n, k), dtype=fp8_blocks.FP8_DTYPE, device=x.device)
    scale = torch.empty((n, kb), dtype=torch.float32, device=x.device)
    if n == 0 or k == 0:
        return q, scale
    groups = min(QUANT_GROUPS, triton.next_power_of_2(kb))
    _act_quant_kernel[(n, triton.cdiv(kb, groups))](
        x,
        q,
        scale,
        k,
        kb,
        x.stride(0),
        q.stride(0),
        scale.stride(0),
        GROUPS=groups,
        BLOCK=BLOCK_K,
        POW2=pow2,
        **launch(x.device, _act_quant_kernel),
    )
    return q, scale


# ---------------------------------------------------------------- the GEMM


@triton.jit
def _block_linear_kernel(
    x_ptr,  # [M, K] float8_e4m3fn
    xs_ptr,  # [M, KB] float32
    w_ptr,  # [N, K] float8_e4m3fn
    ws_ptr,  # [ceil(N / 128), KB] float32
    out_ptr,  # [M, N], or with split K a float32 partial [S, M, N]
    M,
    N,
    K,
    KB,
    SPLIT_BLOCKS,  # K blocks a split sums (all of them without split K)
    stride_xm,
    stride_xsm,
    stride_xsk,
    stride_wn,
    stride_wsn,
    stride_wsk,
    stride_os,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,  # tl.dot's operand dtype: fp8 compiled, float32 in the interpreter
    PDL: tl.constexpr,
):
    enter(PDL, True)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    first_n = tl.program_id(1) * BLOCK_N
    rn = first_n + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    first_kb = split * SPLIT_BLOCKS
    rk = first_kb * BLOCK_K + tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N]
    xs_ptrs = xs_ptr + rm.to(tl.int64) * stride_xsm  # [BLOCK_M]
    ws_row = ws_ptr + (first_n // BLOCK_K) * stride_wsn  # the tile's one weight-scale row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(first_kb, tl.minimum(first_kb + SPLIT_BLOCKS, KB)):
        k_ok = rk < K
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        x_scale = tl.load(xs_ptrs + kb * stride_xsk, mask=m_ok, other=0.0)
        w_scale = tl.load(ws_row + kb * stride_wsk)
        part = tl.dot(x.to(DOT), w.to(DOT))  # [BLOCK_M, BLOCK_N] float32, this K block only
        acc += part * x_scale[:, None] * w_scale  # the reference's order: (part * xs) * ws
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        rk += BLOCK_K
    out_ptrs = (
        out_ptr
        + split.to(tl.int64) * stride_os
        + rm[:, None].to(tl.int64) * stride_om
        + rn[None, :]
    )
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(
    part_ptr,  # [S, M * N] float32
    out_ptr,  # [M * N]
    MN,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, True)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    part_ptrs = part_ptr + offs
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for _ in tl.static_range(SPLITS):  # in split order, so in K order
        acc += tl.load(part_ptrs, mask=ok, other=0.0)
        part_ptrs += MN
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _dot_dtype(kernel: object) -> tl.dtype:
    """fp8 on the tensor cores; float32 copies in the interpreter (numpy has no fp8)."""
    return tl.float32 if isinstance(kernel, InterpretedFunction) else tl.float8e4nv


def block_linear(
    x_q: torch.Tensor,  # [N, K] float8_e4m3fn
    x_scale: torch.Tensor,  # [N, ceil(K / 128)] float32
    weight: torch.Tensor,  # [O, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [ceil(O / 128), ceil(K / 128)] float32
    out_dtype: torch.dtype,
    config: Config | None = None,
) -> torch.Tensor:  # [N, O]
    """fp8_blocks.block_linear on the tensor cores (module docstring), with no host sync."""
    n, k = x_q.shape
    o = weight.shape[0]
    kb, ob = triton.cdiv(k, BLOCK_K), triton.cdiv(o, BLOCK_K)
    fp8 = fp8_blocks.FP8_DTYPE
    if (
        x_q.dtype != fp8
        or weight.dtype != fp8
        or weight.dim() != 2
        or weight.shape[1] != k
        or x_scale.shape != (n, kb)
        or weight_scale.shape != (ob, kb)
        or x_scale.dtype != torch.float32
        or weight_scale.dtype != torch.float32
        or x_q.stride(-1) != 1
        or weight.stride(-1) != 1
        or out_dtype not in IN_DTYPES
    ):
        raise ValueError(
            f"block_linear: x_q {tuple(x_q.shape)} {x_q.dtype}, x_scale "
            f"{tuple(x_scale.shape)} {x_scale.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype}, weight_scale {tuple(weight_scale.shape)} {weight_scale.dtype}, "
            f"out {out_dtype}: wants float8_e4m3fn [N, K] and [O, K] (unit stride in K), "
            "float32 scales [N, ceil(K/128)] and [ceil(O/128), ceil(K/128)], a float out dtype"
        )
    out = torch.empty((n, o), dtype=out_dtype, device=x_q.device)
    if n == 0 or o == 0:
        return out
    cfg = config or config_for(n, o, k)
    per_split = triton.cdiv(kb, min(cfg.split_k, kb))
    splits = triton.cdiv(kb, per_split)  # none empty
    part = (
        out if splits == 1 else torch.empty((splits, n, o), dtype=torch.float32, device=out.device)
    )
    grid = (triton.cdiv(n, cfg.block_m), triton.cdiv(o, cfg.block_n), splits)
    _block_linear_kernel[grid](
        x_q,
        x_scale,
        weight,
        weight_scale,
        part,
        n,
        o,
        k,
        kb,
        per_split,
        x_q.stride(0),
        x_scale.stride(0),
        x_scale.stride(1),
        weight.stride(0),
        weight_scale.stride(0),
        weight_scale.stride(1),
        part.stride(0) if splits > 1 else 0,
        part.stride(-2),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=BLOCK_K,
        DOT=_dot_dtype(_block_linear_kernel),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch(x_q.device, _block_linear_kernel),
    )
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(n * o, SUM_BLOCK),)](
            part,
            out,
            n * o,
            SPLITS=splits,
            BLOCK=SUM_BLOCK,
            **launch(out.device, _sum_splits_kernel),
        )
    return out


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    config: Config | None = None,
    pow2: bool = False,
) -> torch.Tensor:
    """x [N, K] (the model's dtype) @ the fp8 weight [O, K] -> [N, O] in x's dtype: the
    activation quantised per group (power-of-two scales with `pow2`), then the block-scaled
    product (fp8_blocks.linear)."""
    x_q, x_scale = act_quant(x, pow2)
    return block_linear(x_q, x_scale, weight, weight_scale, x.dtype, config)
