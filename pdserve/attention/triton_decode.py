"""Paged decode attention in Triton: one new token per sequence over its pages in the pool.

Grid (rows, kv_heads, num_splits). A program takes one sequence row, one KV head with all of
its GQA query heads (the group is padded to a tl.dot block of 16: Hq / Hkv may be anything,
7 included), and one split of the row's keys. The row's length comes from `kv_lens` on the
device and its pages from its `page_table` row, both read inside the kernel; a key's address
is page_table[row, token // page_size] * page_stride + (token % page_size) * token_stride,
with the pool view's own strides (the pool is strided across pages; nothing else about its
layout is assumed). Any page size works: pages are looked up per key.

Split-KV: a row's keys are cut into `num_splits` ranges of cdiv(kv_len, num_splits) keys,
rounded up to BLOCK_N, so that a long context at a small batch still fills the GPU. Each
split writes its normalised partial output and its log-sum-exp (base 2) to float32 scratch;
`_reduce_kernel` combines them. With one split the decode kernel writes the output itself.

CUDA graphs: the grid depends only on (rows, kv_heads, num_splits), fixed per graph bucket;
nothing the kernel reads changes shape between steps. A row with kv_len 0 (a padded row of
a bucket) reads no key and writes zeros; its splits write an lse of -inf and the reduce
turns a row whose splits are all -inf into zeros. Accumulation is float32; the output is in
`out`'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.attention.triton_common import LOG2E, block, check_cache, dot_dtype, dot_precision
from pdserve.kernels.pdl import enter, launch

BLOCK_N = 64  # keys per iteration
MAX_SPLITS = 32
MIN_SPLIT_KEYS = 128  # the eager heuristic never splits a row finer than this


@triton.jit
def _decode_kernel(
    q_ptr,  # [rows, Hq, D] (any row stride)
    k_ptr,  # [pages, page_size, Hkv, D]: one layer's pool view
    v_ptr,
    out_ptr,  # [rows, Hq, D]: written when SPLIT is False
    part_out_ptr,  # [rows, Hq, num_splits, D] float32: written when SPLIT is True
    part_lse_ptr,  # [rows, Hq, num_splits] float32
    page_table_ptr,  # [rows, width] int32
    kv_lens_ptr,  # [rows] int32
    scale_log2,  # softmax scale * log2(e)
    num_splits,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_table,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, True)
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kv_lens_ptr + row)
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g  # [BLOCK_G]: this KV head's query heads
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q_off = row * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max (base-2 logits)
    l_sum = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(logit - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = page_table_ptr + row * stride_table
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    for first in range(start, end, BLOCK_N):
        tok = first + n  # [BLOCK_N]
        ok = tok < end
        page = tl.load(table + tok // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        in_page = tok % PAGE_SIZE
        k_off = page * stride_kp + in_page * stride_kt  # [BLOCK_N]
        v_off = page * stride_vp + in_page * stride_vt
        kt = tl.load(  # [BLOCK_D, BLOCK_N]
            k_head + k_off[None, :] + d[:, None] * stride_kd,
            mask=d_ok[:, None] & ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile has a valid key
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        vv = tl.load(  # [BLOCK_N, BLOCK_D]
            v_head + v_off[:, None] + d[None, :] * stride_vd,
            mask=ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), vv, input_precision=PRECISION)
        m = m_new

    seen = l_sum > 0
    o = acc / tl.where(seen, l_sum, 1.0)[:, None]  # zeros where the split saw no key
    o_mask = g_ok[:, None] & d_ok[None, :]
    if SPLIT:
        num_heads = GROUP * tl.num_programs(1)
        part = (row * num_heads + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=o_mask)
        lse = tl.where(seen, m + tl.log2(tl.where(seen, l_sum, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g_ok)
    else:
        o_off = row * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _reduce_kernel(
    part_out_ptr,  # [rows, Hq, num_splits, D] float32
    part_lse_ptr,  # [rows, Hq, num_splits] float32
    out_ptr,  # [rows, Hq, D]
    num_splits,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, True)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    d_ok = d < HEAD_DIM
    part = (row * tl.num_programs(1) + head) * num_splits + s  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row that saw no key: every weight 0
    w = tl.exp2(lse - top)
    o_mask = s_ok[:, None] & d_ok[None, :]
    o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=o_mask, other=0.0)
    total = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    o_off = row * stride_ot + head * stride_oh + d * stride_od
    tl.store(out_ptr + o_off, res.to(out_ptr.dtype.element_ty), mask=d_ok)


def choose_num_splits(rows: int, kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """Splits per row so that rows * kv_heads * splits programs fill the GPU about twice,
    never cutting a row into ranges shorter than MIN_SPLIT_KEYS keys."""
    want = -(-2 * num_sms // max(1, rows * kv_heads))
    by_len = -(-max_kv_len // MIN_SPLIT_KEYS)
    return max(1, min(want, by_len, MAX_SPLITS))


def partial_shapes(
    rows: int, num_heads: int, num_splits: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The float32 scratch a split decode needs: (partial outputs, their log-sum-exps)."""
    return (rows, num_heads, num_splits, head_dim), (rows, num_heads, num_splits)


def split_scratch(
    kernel: str,
    out: torch.Tensor,
    num_splits: int,
    shapes: tuple[tuple[int, ...], tuple[int, ...]],
    partial_out: torch.Tensor | None,
    partial_lse: torch.Tensor | None,
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """(whether the decode splits, the partial outputs and log-sum-exps it writes): the given
    scratch, checked against `shapes` (`partial_shapes`), or `out` twice when it does not
    split (the kernel reads neither then). ValueError naming `kernel` otherwise."""
    if num_splits <= 1:
        return False, out, out
    if partial_out is None or partial_lse is None:
        raise ValueError(f"{kernel}: {num_splits} splits need partial buffers")
    if (partial_out.shape, partial_lse.shape) != shapes or not (
        partial_out.is_contiguous() and partial_lse.is_contiguous()
    ):
        raise ValueError(f"{kernel}: partial buffers must be contiguous {shapes}")
    return True, partial_out, partial_lse


def paged_decode(
    q: torch.Tensor,  # [rows, Hq, D]: one query token per row
    k_cache: torch.Tensor,  # [pages, page_size, Hkv, D]: one layer's pool view
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [rows, width] int32
    kv_lens: torch.Tensor,  # [rows] int32; 0 = a padded row (its output is zeros)
    out: torch.Tensor,  # [rows, Hq, D]: written
    scale: float,
    num_splits: int = 1,
    partial_out: torch.Tensor | None = None,  # partial_shapes(...) float32, when num_splits > 1
    partial_lse: torch.Tensor | None = None,
    block_n: int = BLOCK_N,
    num_warps: int = 4,
    num_stages: int = 3,
) -> None:
    """out[r] = softmax(q[r] . K[r]^T * scale) . V[r] over the first kv_lens[r] keys of row r's
    pages. Launches depend only on the tensors' shapes (graph-safe). `block_n`, `num_warps`
    and `num_stages` tune the decode kernel (benchmarks/kernels/attention_kernels.py sweeps
    them)."""
    check_cache(k_cache, "k_cache")
    check_cache(v_cache, "v_cache")
    rows, num_heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    if num_heads % kv_heads or k_cache.shape[3] != dim or out.shape != q.shape:
        raise ValueError(
            f"paged_decode: q {tuple(q.shape)}, out {tuple(out.shape)} and a cache of "
            f"{tuple(k_cache.shape)} do not fit (query heads must be a multiple of KV heads)"
        )
    if page_table.shape[0] != rows or kv_lens.shape != (rows,):
        raise ValueError(
            f"paged_decode: {rows} rows, page table {tuple(page_table.shape)}, "
            f"kv_lens {tuple(kv_lens.shape)}"
        )
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"paged_decode: block_n must be a power of two >= 16, got {block_n}")
    if rows == 0:
        return
    shapes = partial_shapes(rows, num_heads, num_splits, dim)
    split, part_out, part_lse = split_scratch(
        "paged_decode", out, num_splits, shapes, partial_out, partial_lse
    )
    group = num_heads // kv_heads
    dtype = dot_dtype(q.dtype, _decode_kernel)
    _decode_kernel[(rows, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        page_table,
        kv_lens,
        scale * LOG2E,
        num_splits,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        page_table.stride(0),
        PAGE_SIZE=k_cache.shape[1],
        GROUP=group,
        HEAD_DIM=dim,
        BLOCK_G=block(group),
        BLOCK_D=block(dim),
        BLOCK_N=block_n,
        SPLIT=split,
        DOT_DTYPE=dtype,
        PRECISION=dot_precision(dtype),
        num_warps=num_warps,
        num_stages=num_stages,
        **launch(q.device, _decode_kernel),
    )
    if split:
        reduce_splits(part_out, part_lse, out)


def reduce_splits(
    partial_out: torch.Tensor,  # [rows, Hq, num_splits, D] float32, contiguous
    partial_lse: torch.Tensor,  # [rows, Hq, num_splits] float32, contiguous
    out: torch.Tensor,  # [rows, Hq, D]: written
) -> None:
    """out = the splits' partial outputs weighted by their log-sum-exps (zeros where no
    split saw a key): the second kernel of a split decode, this one's and latent attention's
    (attention/triton_mla_decode.py)."""
    rows, num_heads, num_splits, dim = partial_out.shape
    _reduce_kernel[(rows, num_heads)](
        partial_out,
        partial_lse,
        out,
        num_splits,
        *out.stride(),
        HEAD_DIM=dim,
        BLOCK_S=block(num_splits, 1),
        BLOCK_D=block(dim, 1),
        **launch(out.device, _reduce_kernel),
    )
