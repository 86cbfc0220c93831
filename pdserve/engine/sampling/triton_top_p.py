"""top_p without sorting, as one Triton kernel on CUDA: a radix select on the logits' bits.

`processors.filter_top_p` keeps, per row, the smallest prefix of the tokens in a stable
descending order (ties by token id) whose probability mass reaches top_p. Sorting the whole
row to find that prefix cost 3.5 ms at 128 rows x 151,936 tokens on an H200 (the top_p row of
the sampler table in benchmarks/RESULTS.md), twice a decode step of a 1B model. The prefix is
fixed by one number, the logit t* of its last token: every token above t* is kept, every
token below is dropped, and of the tokens equal to t* the first c by id are kept. This kernel
finds t* without ordering anything:

* each float32 logit maps to a 32-bit key that orders as the floats do (`_ukey`);
* eight passes over the row fix t*'s key four bits at a time, from the top: a pass sums the
  probability mass of the tokens whose key matches the bits fixed so far, per value of the
  next four bits, and takes the highest digit at which the mass above plus the mass at and
  above that digit reaches top_p (a radix select weighted by probability);
* a last pass keeps the tokens above t*, and of those equal to t* the first
  c = ceil((top_p - mass above t*) / p(t*)), counted in token order.

One program per filtered row, nine passes streaming the row: the mass sums are float32 in
another order than the sorted path's cumsum, so the two can disagree only where a prefix's
mass is within rounding of top_p. On the CPU the sorted path stays (the reference; the
tests run this kernel in Triton's interpreter against it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
DIGITS = 16  # four bits a pass
PASSES = 8  # 32-bit keys


@triton.jit
def _ukey(z):
    """float32 -> int64 in [0, 2**32), ordered as the floats (-0.0 already made +0.0)."""
    bits = z.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed int32, ordered as z
    return key.to(tl.int64) + 2147483648


@triton.jit
def _top_p_kernel(
    z_ptr,  # [R, V] float32, filtered in place
    rows_ptr,  # [Q] int64: the rows with top_p < 1
    top_p_ptr,  # [Q] float32
    lse_ptr,  # [Q] float32: logsumexp of each filtered row
    z_stride,
    V,
    BLOCK_V: tl.constexpr,
    NUM_DIGITS: tl.constexpr,
    NUM_PASSES: tl.constexpr,
):
    q_idx = tl.program_id(0)
    row = tl.load(rows_ptr + q_idx)
    top_p = tl.load(top_p_ptr + q_idx)
    lse = tl.load(lse_ptr + q_idx)
    base = z_ptr + row * z_stride
    b = tl.arange(0, NUM_DIGITS)  # bucket b holds digit NUM_DIGITS - 1 - b: the top first
    above = top_p * 0.0  # mass of the tokens known to rank above t* (a float32 scalar)
    prefix = row * 0  # t*'s key bits fixed so far (an int64 scalar)
    for i in tl.static_range(NUM_PASSES):
        shift = 28 - 4 * i
        mass = tl.zeros([NUM_DIGITS], tl.float32)
        for start in range(0, V, BLOCK_V):
            ids = start + tl.arange(0, BLOCK_V)
            ok = ids < V
            z = tl.load(base + ids, mask=ok, other=float("-inf")) + 0.0
            k = _ukey(z)
            p = tl.where(ok, tl.exp(z - lse), 0.0)
            match = (k >> (shift + 4)) == prefix
            bucket = NUM_DIGITS - 1 - ((k >> shift) & (NUM_DIGITS - 1))
            hit = (bucket[:, None] == b[None, :]) & match[:, None]
            mass += tl.sum(tl.where(hit, p[:, None], 0.0), axis=0)
        reach = (above + tl.cumsum(mass, 0)) >= top_p
        first = tl.min(tl.where(reach, b, NUM_DIGITS), 0)
        # Rounding can leave the whole mass a hair under top_p: then keep every token that
        # has any mass (the lowest non-empty bucket).
        lowest = tl.max(tl.where(mass > 0, b, 0), 0)
        chosen = tl.where(first == NUM_DIGITS, lowest, first)
        above += tl.sum(tl.where(b < chosen, mass, 0.0), 0)
        prefix = prefix * NUM_DIGITS + (NUM_DIGITS - 1 - chosen)
    # t* back from its key; c of the tokens equal to it stay, in token order.
    key = (prefix - 2147483648).to(tl.int32)
    t_star = tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)
    q = tl.exp(t_star - lse)
    c = tl.maximum(tl.ceil((top_p - above) / q), 1.0)
    seen = top_p * 0.0  # tokens equal to t* in earlier blocks
    for start in range(0, V, BLOCK_V):
        ids = start + tl.arange(0, BLOCK_V)
        ok = ids < V
        z = tl.load(base + ids, mask=ok, other=float("-inf")) + 0.0
        k = _ukey(z)
        tie = (k == prefix) & ok
        tie_f = tie.to(tl.float32)
        rank = seen + tl.cumsum(tie_f, 0) - tie_f  # ties before this one
        keep = (k > prefix) | (tie & (rank < c))
        tl.store(base + ids, float("-inf"), mask=ok & ~keep)
        seen += tl.sum(tie_f, 0)


def filter_top_p_(z: torch.Tensor, rows: torch.Tensor, top_p: torch.Tensor) -> None:
    """In place on z [R, V] float32 (scaled, filtered logits; -inf = excluded): for each
    rows[i] (int64), keep the top_p[i] prefix as `processors.filter_top_p` defines it."""
    if rows.numel() == 0:
        return
    if z.stride(1) != 1:
        raise ValueError("filter_top_p_ needs each row's logits contiguous")
    lse = torch.logsumexp(z.index_select(0, rows), dim=-1).float()
    _top_p_kernel[(rows.numel(),)](
        z,
        rows,
        top_p.reshape(-1).float().contiguous(),
        lse,
        z.stride(0),
        z.shape[1],
        BLOCK_V=BLOCK,
        NUM_DIGITS=DIGITS,
        NUM_PASSES=PASSES,
        num_warps=8,
    )
