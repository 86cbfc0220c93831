"""Paged decode of multi-head latent attention in its absorbed form, in Triton: one new token
per sequence over the latent buffer's pages (model/mla.py, model/mla_absorbed.py).

Absorbed, MLA is multi-query attention with one KV row a token: the cached latent row
[kv_lora_rank R | qk_rope_head_dim P] (the normed latent c, then the rotated key k_rope that
every head shares). Query head h brings q_latent[h] [R] (its non-rotary query folded through
kv_b_proj's key half) and q_rope[h] [P]; its score for a token is
(q_latent[h] . c + q_rope[h] . k_rope) * scale, and its output is the softmax-weighted sum of
the tokens' c [R] (kv_b_proj's value half is applied by the model afterwards). So a key tile
is loaded once and serves as both keys and values, for a block of heads.

Grid (rows, cdiv(heads, BLOCK_H), num_splits). A program takes one sequence row, BLOCK_H query
heads (a tl.dot block: at least 16, heads past the last masked) and one split of the row's
keys; the KV row it loads serves all of them. Pages are read as in the decode kernel
(attention/triton_decode.py): the row's length from `kv_lens` and its pages from its
`page_table` row, on the device; a token's row is at page_table[row, token // page_size] *
page_stride + (token % page_size) * token_stride with the latent view's own strides (the pool
is strided across pages: kvcache/pool.py `view`). With a key list (`keys`, DeepSeek-V3.2's
indexer picks) the row's n-th key is the token at position keys[row, n] instead of n, and
`kv_lens` counts the list's entries: sparse attention over the chosen tokens, same pages.

Split-KV exactly as the decode kernel's: a row's keys in `num_splits` ranges of
cdiv(kv_len, num_splits) keys rounded up to BLOCK_N; each split writes its normalised partial
output and base-2 log-sum-exp to float32 scratch, which `reduce_splits` (triton_decode.py)
combines; a split past the row's end, and a row with kv_len 0 (a padded row), reads nothing
and weighs nothing (zeros out). The grid depends only on the row count, the head count and
the split count, never on lengths: CUDA-graph safe. Accumulation is float32; the output is in
`out`'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.attention.triton_common import LOG2E, block, dot_dtype, dot_precision
from pdserve.attention.triton_decode import partial_shapes, reduce_splits, split_scratch
from pdserve.kernels.pdl import enter, launch

BLOCK_H = 16  # query heads per program (tl.dot's smallest side)
BLOCK_N = 32  # keys per iteration: a [32, 512] latent tile and a [16, 512] float32 accumulator


@triton.jit
def _latent_decode_kernel(
    q_latent_ptr,  # [rows, H, R] (any strides)
    q_rope_ptr,  # [rows, H, P]
    cache_ptr,  # [pages, page_size, 1, R + P]: one layer's latent view
    out_ptr,  # [rows, H, R]: written when SPLIT is False
    part_out_ptr,  # [rows, H, num_splits, R] float32: written when SPLIT is True
    part_lse_ptr,  # [rows, H, num_splits] float32
    page_table_ptr,  # [rows, width] int32
    kv_lens_ptr,  # [rows] int32: keys to read (INDEXED: entries of the row's key list)
    keys_ptr,  # [rows, K] int32: the key positions to read (read when INDEXED)
    scale_log2,  # softmax scale * log2(e)
    num_splits,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_rt,
    stride_rh,
    stride_rd,
    stride_cp,
    stride_ct,
    stride_cd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_table,
    stride_keys,
    PAGE_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    RANK: tl.constexpr,  # R: the latent's width, also each head's output width
    ROPE: tl.constexpr,  # P
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    INDEXED: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, True)
    row = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kv_lens_ptr + row)
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)

    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    h_ok = h < NUM_HEADS
    r_ok = r < RANK
    p_ok = p < ROPE
    q_off = row * stride_qt + h[:, None] * stride_qh + r[None, :] * stride_qd
    q_lat = tl.load(q_latent_ptr + q_off, mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    qr_off = row * stride_rt + h[:, None] * stride_rh + p[None, :] * stride_rd
    q_rot = tl.load(q_rope_ptr + qr_off, mask=h_ok[:, None] & p_ok[None, :], other=0.0)
    q_lat = q_lat.to(DOT_DTYPE)
    q_rot = q_rot.to(DOT_DTYPE)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (base-2 logits)
    l_sum = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(logit - m)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    table = page_table_ptr + row * stride_table
    for first in range(start, end, BLOCK_N):
        tok = first + n  # [BLOCK_N]
        ok = tok < end
        if INDEXED:  # the row's tok-th listed key
            tok = tl.load(keys_ptr + row * stride_keys + tok, mask=ok, other=0)
        page = tl.load(table + tok // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        at = cache_ptr + page * stride_cp + (tok % PAGE_SIZE) * stride_ct  # [BLOCK_N]
        c = tl.load(  # [BLOCK_N, BLOCK_R]: the keys' latent part, and the values
            at[:, None] + r[None, :] * stride_cd, mask=ok[:, None] & r_ok[None, :], other=0.0
        ).to(DOT_DTYPE)
        k_rot = tl.load(  # [BLOCK_N, BLOCK_P]
            at[:, None] + (RANK + p)[None, :] * stride_cd,
            mask=ok[:, None] & p_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N]
        s += tl.dot(q_rot, tl.trans(k_rot), input_precision=PRECISION)
        s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile has a valid key
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.dot(w.to(DOT_DTYPE), c, input_precision=PRECISION)
        m = m_new

    seen = l_sum > 0
    o = acc / tl.where(seen, l_sum, 1.0)[:, None]  # zeros where the split saw no key
    o_mask = h_ok[:, None] & r_ok[None, :]
    if SPLIT:
        part = (row * NUM_HEADS + h) * num_splits + split  # [BLOCK_H]
        tl.store(part_out_ptr + part[:, None] * RANK + r[None, :], o, mask=o_mask)
        lse = tl.where(seen, m + tl.log2(tl.where(seen, l_sum, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=h_ok)
    else:
        o_off = row * stride_ot + h[:, None] * stride_oh + r[None, :] * stride_od
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=o_mask)


def head_blocks(num_heads: int, block_h: int = BLOCK_H) -> int:
    """Programs a row's heads take per split (what the split heuristic counts per row)."""
    return -(-num_heads // block_h)


def paged_latent_decode(
    q_latent: torch.Tensor,  # [rows, H, R]: one query token per row, absorbed
    q_rope: torch.Tensor,  # [rows, H, P]: its rotated part
    cache: torch.Tensor,  # [pages, page_size, 1, R + P]: one layer's latent view
    page_table: torch.Tensor,  # [rows, width] int32
    kv_lens: torch.Tensor,  # [rows] int32; 0 = a padded row (its output is zeros)
    out: torch.Tensor,  # [rows, H, R]: written
    scale: float,
    num_splits: int = 1,
    partial_out: torch.Tensor | None = None,  # partial_shapes(rows, H, splits, R) float32
    partial_lse: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,  # [rows, K] int32: attend to these positions only
    block_h: int = BLOCK_H,
    block_n: int = BLOCK_N,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    """out[r, h] = softmax((q_latent[r, h] . C[r]^T + q_rope[r, h] . K_rope[r]^T) * scale) . C[r]
    over the first kv_lens[r] latent rows of row r's pages (C: their first R values, K_rope
    the rest); with `keys`, over the rows at positions keys[r, :kv_lens[r]] instead (V3.2's
    picks: attention/triton_index_scores.py). Launches depend only on the tensors' shapes
    (graph-safe). `block_h`, `block_n`, `num_warps` and `num_stages` tune the kernel
    (benchmarks/kernels/mla_decode.py)."""
    rows, heads, rank = q_latent.shape
    rope = q_rope.shape[2]
    if (
        cache.dim() != 4
        or cache.shape[2] != 1
        or cache.shape[3] != rank + rope
        or q_rope.shape[:2] != (rows, heads)
        or out.shape != q_latent.shape
    ):
        raise ValueError(
            f"paged_latent_decode: q_latent {tuple(q_latent.shape)}, q_rope "
            f"{tuple(q_rope.shape)} and out {tuple(out.shape)} do not fit a latent cache of "
            f"{tuple(cache.shape)} ([pages, page_size, 1, R + P])"
        )
    if (
        page_table.shape[0] != rows
        or kv_lens.shape != (rows,)
        or (keys is not None and (keys.dim() != 2 or keys.shape[0] != rows or keys.stride(1) != 1))
    ):
        raise ValueError(
            f"paged_latent_decode: {rows} rows, page table {tuple(page_table.shape)}, "
            f"kv_lens {tuple(kv_lens.shape)}, keys "
            f"{None if keys is None else tuple(keys.shape)}"
        )
    for what, n in (("block_h", block_h), ("block_n", block_n)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"paged_latent_decode: {what} must be a power of two >= 16, got {n}")
    if q_rope.dtype != q_latent.dtype:
        raise ValueError(f"q_latent is {q_latent.dtype} but q_rope is {q_rope.dtype}")
    if rows == 0:
        return
    shapes = partial_shapes(rows, heads, num_splits, rank)
    split, part_out, part_lse = split_scratch(
        "paged_latent_decode", out, num_splits, shapes, partial_out, partial_lse
    )
    dtype = dot_dtype(q_latent.dtype, _latent_decode_kernel)
    _latent_decode_kernel[(rows, head_blocks(heads, block_h), num_splits)](
        q_latent,
        q_rope,
        cache,
        out,
        part_out,
        part_lse,
        page_table,
        kv_lens,
        keys if keys is not None else kv_lens,  # (not read unless INDEXED)
        scale * LOG2E,
        num_splits,
        *q_latent.stride(),
        *q_rope.stride(),
        cache.stride(0),
        cache.stride(1),
        cache.stride(3),
        *out.stride(),
        page_table.stride(0),
        keys.stride(0) if keys is not None else 0,
        PAGE_SIZE=cache.shape[1],
        NUM_HEADS=heads,
        RANK=rank,
        ROPE=rope,
        BLOCK_H=block_h,
        BLOCK_R=block(rank),
        BLOCK_P=block(rope),
        BLOCK_N=block_n,
        SPLIT=split,
        INDEXED=keys is not None,
        DOT_DTYPE=dtype,
        PRECISION=dot_precision(dtype),
        num_warps=num_warps,
        num_stages=num_stages,
        **launch(q_latent.device, _latent_decode_kernel),
    )
    if split:
        reduce_splits(part_out, part_lse, out)
