"""A Triton matrix-vector product for the batch-1 decode step: y = x @ W.T (+ b), x one row.

Why not cuBLAS: at batch 1 each of a layer's weight products is one pass over W and nothing
else, and should run at the copy rate. Inside a CUDA graph cuBLAS falls well short of it on
the built-in shapes' smaller matrices, and this kernel is faster on all but one of them
(benchmarks/kernels/gemv.py; benchmarks/RESULTS.md, 2026-12-02). With two or more rows cuBLAS was as
fast as any tiled Triton matmul a sweep tried, so kernels/ops.py sends only single rows here.

The kernel: one program per BLOCK_N output columns streams those rows of W once, BLOCK_K
columns a load, multiplying elementwise in float32 and summing once at the end. What makes
it fast is many programs with long loads: BLOCK_N of 1-4 (N/BLOCK_N = 450-4,000 programs)
and BLOCK_K of 1K elements (2 KB of a row a load), found by the sweep (`config_for`). No
split-K: each output's sum runs over K in one fixed order in one program (deterministic, no
atomics, no second pass).

`silu_mul`: x is an MLP's [1, 2K] gate-up output and the product is of silu(gate) * up,
rounded as kernels/triton_fused.silu_mul rounds it, so the fused down projection equals the
two kernels bit for bit while saving one launch and the [1, K] round trip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.pdl import enter, launch


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _load_x(gate_ptrs, up_ptrs, mask, SILU_MUL: tl.constexpr):
    """A block of x; with SILU_MUL, silu(gate) * up rounded as kernels/triton_fused.silu_mul
    rounds it (so the fused product equals silu_mul then the product, bit for bit)."""
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    if SILU_MUL:
        up = tl.load(up_ptrs, mask=mask, other=0.0)
        g32 = gate.to(tl.float32)
        silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
        return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    return gate


@triton.jit
def _gemv_kernel(
    x_ptr,  # [1, K], or [1, 2K] (gate, then up) with SILU_MUL
    w_ptr,  # [N, K]
    b_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [1, N]
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, True)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:
            x = _load_x(x_ptr + k0 + rk, x_ptr + K + k0 + rk, rk >= 0, SILU_MUL)
            w = tl.load(w_ptrs + k0)
        else:
            kmask = k0 + rk < K
            x = _load_x(x_ptr + k0 + rk, x_ptr + K + k0 + rk, kmask, SILU_MUL)
            w = tl.load(w_ptrs + k0, mask=(rn[:, None] < N) & kmask[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=rn < N)


def config_for(n: int, k: int, silu_mul: bool = False) -> Config:
    """The blocks for a [1, k] x [n, k].T product: the sweep's winners as a rule
    (`benchmarks/kernels/gemv.py --sweep`). Many programs with 1K-element loads: one row of W a
    program along a long K (the down projection), else 2, or 4 for the widest (gate-up); with
    `silu_mul` 8 rows and 8 warps, since every program recomputes silu(gate) * up over all of K
    and more rows share that cost."""
    if silu_mul:
        return Config(block_n=8, block_k=1024, num_warps=8, num_stages=3)
    block_n = 1 if k >= 4096 else 4 if n > 12288 else 2
    return Config(block_n=block_n, block_k=1024, num_warps=4, num_stages=3)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` takes these operands: one 16-bit row, unit stride along K."""
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and weight.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def gemv(
    x: torch.Tensor,  # [1, K], or [1, 2K] (gate, then up) with silu_mul
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    silu_mul: bool = False,
    config: Config | None = None,
) -> torch.Tensor:  # [1, N], x's dtype
    """x @ weight.T + bias for operands `supports` accepts; with `silu_mul`,
    (silu(x[:, :K]) * x[:, K:]) @ weight.T + bias without materialising the product."""
    n, k = weight.shape[0], weight.shape[-1]
    if not supports(x, weight) or x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(
            f"gemv: x {tuple(x.shape)} {x.dtype} (stride {x.stride()}), weight "
            f"{tuple(weight.shape)} {weight.dtype}, silu_mul={silu_mul}: wants one 16-bit "
            f"[1, {'2K' if silu_mul else 'K'}] row and a [N, K] weight of its dtype"
        )
    cfg = config or config_for(n, k, silu_mul)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x,
        weight,
        bias if bias is not None else weight,  # any pointer: unread without HAS_BIAS
        out,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul,
        EVEN=n % cfg.block_n == 0 and k % cfg.block_k == 0,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch(x.device, _gemv_kernel),
    )
    return out
