"""The fused MoE's block rule (kernels/triton_moe.py, kernels/triton_moe_fp8.py): how many
sorted assignments, output columns and reduction columns one program takes, by shape."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from pdserve.kernels.fp8_blocks import BLOCK

MIN_DOT = 16  # tl.dot's smallest block side


@dataclass(frozen=True)
class Config:
    block_m: int  # sorted assignments per program (the alignment's padding unit)
    block_n: int  # output columns per program
    block_k: int  # reduction columns per load
    num_warps: int
    num_stages: int


def config_for(
    num_tokens: int,
    hidden: int,
    intermediate: int,
    top_k: int,
    num_experts: int,
    dtype: torch.dtype = torch.bfloat16,
    fp8: bool = False,
) -> Config:
    """The blocks for N tokens through experts of (H, I). Rows per expert hit, with routing
    spread evenly: A / min(A, E). Up to 16 (decode), BLOCK_M 16 and narrow, long tiles
    (BLOCK_N 32, BLOCK_K 128): each expert's weights stream once through many programs. More
    rows, larger BLOCK_M so each weight tile serves more of them; 8 warps for 128-row blocks.
    float32 tiles are twice the bytes: one stage fewer. Sides shrink to fit small H and I.
    fp8 experts (`fp8`): BLOCK_K is always the 128 of a scale block (one activation scale per
    row and one weight scale per column per step; a short H or I is masked), which in e4m3
    costs the bytes of a 16-bit BLOCK_K 64, so the stages stay; and the operands are e4m3
    whatever x's dtype, so float32 x loses no stage."""
    assignments = max(1, num_tokens * top_k)
    rows = assignments / min(assignments, num_experts)
    if rows <= 16:
        m, n, k, warps, stages = 16, 32, 128, 4, 4
    elif rows <= 32:
        m, n, k, warps, stages = 32, 64, 128, 4, 3
    elif rows <= 128:
        m, n, k, warps, stages = 64, 64, 64, 4, 3
    else:
        m, n, k, warps, stages = 128, 64, 64, 8, 3
    fit = max(MIN_DOT, triton.next_power_of_2(min(hidden, intermediate)))
    if fp8:
        return Config(m, min(n, fit), BLOCK, warps, stages)
    if dtype == torch.float32:
        stages -= 1
    return Config(m, min(n, fit), min(k, fit), warps, stages)
