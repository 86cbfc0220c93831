"""The token-to-expert assignments of a mixture-of-experts layer, sorted by expert on the device
and padded per expert to the grouped GEMM's block: what kernels/triton_moe.py multiplies.

A layer's router gives each of N tokens top_k experts: A = N * top_k assignments, assignment
`a = token * top_k + slot`. The grouped GEMMs run one program per BLOCK_M rows of ONE expert,
so the assignments are laid out expert by expert (in expert order; within an expert in
assignment order, so the layout is deterministic), each expert's run padded up to a multiple
of BLOCK_M. Every position past an expert's assignments, up to its run's end, holds A: an
index past every assignment, which the GEMMs mask (they never read a row for it).

Why a Triton kernel and no torch ops: the layout must come out in buffers whose shapes do not
depend on the routing, with no host read of how many tokens each expert got, so that a layer
runs inside a CUDA graph and replays with any routing. The buffers are sized for the worst
case (`capacity`): at most min(A, E) experts get a token, and each pads at most BLOCK_M - 1
positions, so the padded length is at most A + min(A, E) * (BLOCK_M - 1) (rounded down to a
whole block: every run is whole blocks). Blocks past the padded length in use (`total`, on
the device) hold stale values and the GEMMs skip them.

The kernel: one program per expert. Each counts every expert's assignments (a histogram over
all of them, CHUNK at a time), from which its run's start is the sum of the padded runs
before it; it then writes its blocks' expert id, its own assignments in order, and its
padding. Every program reads all A ids twice: nothing for a decode step (A = batch * top_k),
and still a small cost beside the GEMMs for a long prefill; in exchange it is one launch with
no atomics and no second pass.

An assignment whose id is `num_experts` or more is nobody's (expert parallel: another rank's
expert, model/moe.py): it is counted for no expert, so it is in no block and no GEMM reads its
token for it, and `_sum_kernel` (kernels/triton_moe.py) skips its slot.

`block_of` is the GEMMs' side of the layout: a program's assignments and expert.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.kernels.pdl import enter, launch


class Alignment(NamedTuple):
    """Assignments sorted by expert, padded per expert to `block_m` (buffers of `capacity`)."""

    sorted_ids: torch.Tensor  # [capacity] int32: the assignment at each position, A for padding
    block_expert: torch.Tensor  # [capacity // block_m] int32: each block's expert
    total: torch.Tensor  # [1] int32: the padded length in use (the blocks past it are stale)
    block_m: int


def capacity(num_assignments: int, num_experts: int, block_m: int) -> int:
    """The longest padded layout A assignments to E experts can need, in whole blocks."""
    worst = num_assignments + min(num_assignments, num_experts) * (block_m - 1)
    return worst // block_m * block_m


@triton.jit
def _align_kernel(
    ids_ptr,  # [A]: each assignment's expert (the router's [N, top_k], flat)
    sorted_ptr,  # [capacity] int32
    block_expert_ptr,  # [capacity // BLOCK_M] int32
    total_ptr,  # [1] int32
    A,
    E,  # the experts: an id past them is nobody's (the module docstring)
    BINS: tl.constexpr,  # a power of two >= the number of experts
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, True)
    expert = tl.program_id(0)
    chunk = tl.arange(0, CHUNK)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for a0 in range(0, A, CHUNK):
        m = a0 + chunk < A
        ids = tl.load(ids_ptr + a0 + chunk, mask=m, other=0).to(tl.int32)
        counts += tl.histogram(ids, BINS, mask=m & (ids < E))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, 0) - padded
    bins = tl.arange(0, BINS)
    start = tl.sum(tl.where(bins == expert, starts, 0))
    mine = tl.sum(tl.where(bins == expert, counts, 0))
    run = tl.sum(tl.where(bins == expert, padded, 0))
    if expert == 0:
        tl.store(total_ptr, tl.sum(padded))
    # this expert's blocks
    first_block = start // BLOCK_M
    for b0 in range(0, run // BLOCK_M, CHUNK):
        b = b0 + chunk
        tl.store(block_expert_ptr + first_block + b, expert + 0 * b, mask=b < run // BLOCK_M)
    # its assignments, in order
    seen = tl.sum(tl.zeros([CHUNK], dtype=tl.int32))
    for a0 in range(0, A, CHUNK):
        a = a0 + chunk
        ids = tl.load(ids_ptr + a, mask=a < A, other=0).to(tl.int32)
        hit = (ids == expert) & (a < A)
        rank = seen + tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(sorted_ptr + start + rank, a, mask=hit)
        seen += tl.sum(hit.to(tl.int32))
    # its padding: fewer than BLOCK_M positions
    pad = start + mine + tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + pad, A + 0 * pad, mask=pad < start + run)


@triton.jit
def block_of(sorted_ptr, block_expert_ptr, A, BLOCK_M: tl.constexpr):
    """A grouped GEMM program's block of the layout (axis 0 of its grid): its assignments
    [BLOCK_M], which of them are real (padding holds A), and its expert."""
    pid_m = tl.program_id(0)
    a = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    return a, a < A, expert


def align(ids: torch.Tensor, num_experts: int, block_m: int, chunk: int = 1024) -> Alignment:
    """`ids` [N, top_k] (each token's experts, distinct per token, in [0, num_experts); or
    num_experts and more: nobody's, left out) -> the assignments sorted by expert and padded
    per expert to `block_m`, on ids' device, with no host synchronisation. `chunk`: how many
    ids a program reads at a time."""
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"align: ids must be [N, top_k] int32/int64, got {tuple(ids.shape)} {ids.dtype}"
        )
    if block_m < 1 or block_m & (block_m - 1) or chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"align: block_m {block_m} and chunk {chunk} must be powers of two")
    flat = ids.reshape(-1).contiguous()  # [A]
    n = flat.numel()
    cap = capacity(n, num_experts, block_m)
    out = Alignment(
        sorted_ids=torch.empty(cap, dtype=torch.int32, device=ids.device),
        block_expert=torch.empty(cap // block_m, dtype=torch.int32, device=ids.device),
        # the kernel writes it (expert 0's program); nothing does when there is no assignment
        total=(torch.zeros if n == 0 else torch.empty)(1, dtype=torch.int32, device=ids.device),
        block_m=block_m,
    )
    if n == 0:
        return out
    _align_kernel[(num_experts,)](
        flat,
        out.sorted_ids,
        out.block_expert,
        out.total,
        n,
        num_experts,
        BINS=triton.next_power_of_2(num_experts),
        BLOCK_M=block_m,
        CHUNK=min(chunk, triton.next_power_of_2(n)),
        **launch(ids.device, _align_kernel),
    )
    return out
