"""Paged prefill attention in Triton: each chunk token over its sequence's cached context and
the chunk itself, causally (chunked prefill), for a varlen batch of chunks.

The chunk's own K/V are already in the pool when this runs (`store_kv` comes first), so every
key, context or new, is read the same way: through the sequence's page table row, with the
pool view's strides, any page size. Sequence b's new tokens are q rows query_start[b] ..
query_start[b+1]; its keys are the first kv_lens[b] tokens of its pages; new token i sits at
position kv_len - q_len + i and sees keys 0 .. that position.

Grid (query blocks, query heads): a program takes BLOCK_M tokens of one chunk for one query
head (reading KV head head // (Hq / Hkv)), and reads keys only up to its last token's position.
The blocks are numbered without a host table, so that the grid depends only on a bound on
the tokens and the number of sequences, never on the chunks' lengths: a CUDA graph captured
over static metadata (engine/prefill_graphs.py) replays it for any chunks that fit. Sequence
j (of those attended here, from first_seq) owns blocks vstart(j) .. vstart(j) +
ceil(q_len_j / BLOCK_M) - 1, where vstart(j) = (query_start[j] - query_start[0]) // BLOCK_M +
j; these ranges never overlap and end before tokens // BLOCK_M + sequences, which sizes the
grid. A program finds its sequence by binary search over vstart; the numbers in between
(and sequences of no tokens: a graph's padding) return at once. A program's arithmetic
depends only on its (sequence, block, head), so every grid that covers the blocks gives the
same bits. float32 accumulation (online softmax in base 2); the output is in `out`'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.attention.triton_common import LOG2E, block, check_cache, dot_dtype, dot_precision
from pdserve.kernels.pdl import enter, launch

BLOCK_M = 64  # query tokens per program
BLOCK_N = 64  # keys per iteration
FP32_BLOCK = 32  # both, for float32 queries: 64 x 64 float32 blocks spill registers


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [pages, page_size, Hkv, D]: one layer's pool view
    v_ptr,
    out_ptr,  # [T, Hq, D]
    page_table_ptr,  # [B, width] int32
    kv_lens_ptr,  # [B] int32
    query_start_ptr,  # [B + 1] int32
    first_seq,  # the first sequence of this launch (the decodes come before it)
    num_seqs,  # sequences first_seq .. first_seq + num_seqs - 1 are attended
    scale_log2,  # softmax scale * log2(e)
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, True)
    vblock = tl.program_id(0)
    head = tl.program_id(1)
    starts = query_start_ptr + first_seq
    base = tl.load(starts)
    lo = vblock * 0  # the last sequence j with vstart(j) <= vblock, in [lo, hi)
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ahead = (tl.load(starts + mid) - base) // BLOCK_M + mid <= vblock
        lo = tl.where(ahead, mid, lo)
        hi = tl.where(ahead, hi, mid)
    seq = first_seq + lo
    q_first = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_first
    q_block = vblock - ((q_first - base) // BLOCK_M + lo)
    if q_block * BLOCK_M >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + seq)
    context = kv_len - q_len  # keys before the chunk

    i = q_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]: token index in the chunk
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    i_ok = i < q_len
    d_ok = d < HEAD_DIM
    rows = (q_first + i).to(tl.int64)
    q_off = rows[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=i_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
    q_pos = context + i  # [BLOCK_M]: each token's position; it sees keys 0 .. q_pos

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = page_table_ptr + seq.to(tl.int64) * stride_table
    kv_head = head // GROUP
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    end = tl.minimum(kv_len, context + (q_block + 1) * BLOCK_M)  # past the block's last key
    for first in range(0, end, BLOCK_N):
        tok = first + n  # [BLOCK_N]
        ok = tok < end
        page = tl.load(table + tok // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        in_page = tok % PAGE_SIZE
        k_off = page * stride_kp + in_page * stride_kt
        v_off = page * stride_vp + in_page * stride_vt
        kt = tl.load(  # [BLOCK_D, BLOCK_N]
            k_head + k_off[None, :] + d[:, None] * stride_kd,
            mask=d_ok[:, None] & ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = ok[None, :] & (tok[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        # Finite from the first tile on: key 0 is visible to every row, even rows past q_len.
        m_new = tl.maximum(m, tl.max(s, 1))
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

    o = acc / l_sum[:, None]
    o_off = rows[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=i_ok[:, None] & d_ok[None, :])


def paged_prefill(
    q: torch.Tensor,  # [T, Hq, D]: the step's queries (decode rows included, not read)
    k_cache: torch.Tensor,  # [pages, page_size, Hkv, D]: one layer's pool view, chunk stored
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, width] int32
    kv_lens: torch.Tensor,  # [B] int32: context + chunk
    query_start: torch.Tensor,  # [B + 1] int32
    first_seq: int,  # sequences first_seq .. B-1 are attended here
    max_tokens: int,  # at least their new tokens, all chunks together (sizes the grid)
    out: torch.Tensor,  # [T, Hq, D]: their rows are written
    scale: float,
) -> None:
    """Causal attention of sequences first_seq .. B-1's new tokens over their pages. A
    sequence of no new tokens is skipped; rows of `out` no sequence covers are not written."""
    check_cache(k_cache, "k_cache")
    check_cache(v_cache, "v_cache")
    _, num_heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    if num_heads % kv_heads or k_cache.shape[3] != dim or out.shape != q.shape:
        raise ValueError(
            f"paged_prefill: q {tuple(q.shape)}, out {tuple(out.shape)} and a cache of "
            f"{tuple(k_cache.shape)} do not fit (query heads must be a multiple of KV heads)"
        )
    num_seqs = kv_lens.shape[0] - first_seq
    if num_seqs <= 0 or max_tokens <= 0:
        return
    dtype = dot_dtype(q.dtype, _prefill_kernel)
    block_m, block_n = (FP32_BLOCK, FP32_BLOCK) if q.dtype == torch.float32 else (BLOCK_M, BLOCK_N)
    grid = (max_tokens // block_m + num_seqs, num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        kv_lens,
        query_start,
        first_seq,
        num_seqs,
        scale * LOG2E,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        page_table.stride(0),
        PAGE_SIZE=k_cache.shape[1],
        GROUP=num_heads // kv_heads,
        HEAD_DIM=dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block(dim),
        DOT_DTYPE=dtype,
        PRECISION=dot_precision(dtype),
        **launch(q.device, _prefill_kernel),
    )
