"""The Gumbel-max draw as one Triton kernel on CUDA: argmax(z + g(key, token)) per row, with the
noise computed in registers from the same keyed hash as `random_stream.gumbel_noise`.

Unfused, the draw materialises int64 and float32 [R, V] tensors over ~20 passes, which at a
large batch and vocabulary takes longer than a decode step of a 1B model (benchmarks/RESULTS.md,
2026-12-01). Here each row is one program streaming its logits once. The integers are the hash's,
bit for bit (int64 arithmetic, every product below 2**63); the two logarithms are libdevice's,
whose last bit may differ from torch's, so a token differs from the unfused draw only where two
candidates tie within that bit (the module header of random_stream.py says the same of CPU vs
CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.sampling.random_stream import MASK32, MUL_1, MUL_2, TOKEN_MUL
from pdserve.kernels.pdl import enter, launch

BLOCK = 2048


@triton.jit
def _log1p(x):
    # log1p(x) for x in (-1, 0]: exact enough where |x| is tiny (where log(1 + x) loses it).
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))


@triton.jit
def _gumbel_argmax_kernel(
    z_ptr,
    keys_ptr,
    out_ptr,
    z_stride,
    V,
    TOKEN_MUL_C: tl.constexpr,
    MUL_1_C: tl.constexpr,
    MUL_2_C: tl.constexpr,
    MASK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, True)
    row = tl.program_id(0).to(tl.int64)
    lo = tl.load(keys_ptr + row * 2)
    hi = tl.load(keys_ptr + row * 2 + 1)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK_V], 0, tl.int64)
    for start in range(0, V, BLOCK_V):
        ids = start + tl.arange(0, BLOCK_V).to(tl.int64)
        mask = ids < V
        z = tl.load(z_ptr + row * z_stride + ids, mask=mask, other=float("-inf"))
        x = (ids * TOKEN_MUL_C) & MASK
        x = x ^ lo
        x = x ^ (x >> 16)
        x = (x * MUL_1_C) & MASK
        x = x ^ hi
        x = x ^ (x >> 15)
        x = (x * MUL_2_C) & MASK
        x = x ^ (x >> 16)
        neg_w = (x + 1).to(tl.float32) * -(2.0**-32)  # -w, w in (0, 1]
        e = -_log1p(neg_w)  # E = -log(1 - w)
        score = z.to(tl.float32) - tl.log(e)  # z + g, g = -log(E)
        score = tl.where(mask, score, float("-inf"))
        better = score > best  # the first index wins a tie, like torch's argmax
        best_idx = tl.where(better, ids, best_idx)
        best = tl.where(better, score, best)
    top = tl.max(best, axis=0)
    cand = tl.where(best == top, best_idx, V)
    tl.store(out_ptr + row, tl.min(cand, axis=0))


def gumbel_argmax(z: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """z [R, V] float32 (scaled, filtered logits; -inf = excluded), keys [R, 2] int64 ->
    [R] int64: argmax(z + gumbel_noise(keys, V)) per row."""
    rows, vocab = z.shape
    out = torch.empty(rows, dtype=torch.int64, device=z.device)
    if rows == 0:
        return out
    z = z if z.stride(1) == 1 else z.contiguous()
    keys = keys.contiguous()
    _gumbel_argmax_kernel[(rows,)](
        z,
        keys,
        out,
        z.stride(0),
        vocab,
        TOKEN_MUL_C=TOKEN_MUL,
        MUL_1_C=MUL_1,
        MUL_2_C=MUL_2,
        MASK=MASK32,
        BLOCK_V=BLOCK,
        **launch(z.device, _gumbel_argmax_kernel),
    )
    return out
