"""DeepSeek-V3.2's indexer on a decode step: each row's index scores over its paged index-K
(a Triton kernel), and its `index_topk` picks as a list of key positions (torch, static
shapes), so that latent attention reads only those keys (attention/triton_mla_decode.py's
`keys`). Both are CUDA-graph safe: shapes depend on the rows and the page table's width, never
on lengths.

The score of row t's key s (model/dsa_indexer.py, HF's math):

    score[t, s] = k_scale[s] * sum_h fw[t, h] * relu(qk_scale * q[t, h] . k[s])

with, for index-K in the model dtype, fw = the head weights and qk_scale = the softmax scale
(k_scale = 1); for fp8 index-K, q the Hadamard-rotated query quantised per (token, head), fw =
weights * q_scale * softmax_scale, qk_scale = 1 and k_scale each key's stored scale (DeepSeek's
fp8 form). Products are exact and sums in float32: with float32 keys by tl.dot "ieee"; with
16-bit keys (whose model made q in the same dtype, then upcast) and with fp8 keys (q then holds
e4m3 values) the dot runs on tensor cores in that 16-bit dtype (bf16 for fp8), where every
product of two such values is exact in its float32 accumulator (in the interpreter, in float32:
attention/triton_common.py). Keys past a row's length score -inf.

Grid (rows, cdiv(width, BLOCK_N)): a program scores one block of one row's keys for all its
heads; a block past the row's length writes -inf and reads nothing.

`pick` takes the `topk` best keys of each row, equal scores going to the lower position (as
`dsa_indexer.select`'s stable sort), and returns them in ascending position order with their
count (min(topk, length)). The kernel sums over heads in its own order, so a score may differ
from `Indexer.scores` (HF's matmul order) in the last bits: keys at a near-tie at the cut may be
picked differently; exactly equal scores are resolved the same way. In a CUDA graph the scores
are as wide as the bucket's page table (the longest context the graphs were sized for), so the
pick's cost follows `max_model_len`, not the batch's contexts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.attention.triton_common import block, dot_dtype, dot_precision
from pdserve.kernels.pdl import enter, launch

BLOCK_N = 32  # keys a program scores


@triton.jit
def _index_scores_kernel(
    q_ptr,  # [rows, H, D] float32
    w_ptr,  # [rows, H] float32: fw
    keys_ptr,  # [pages, page_size, D]: one layer's index-K view
    kscale_ptr,  # [pages, page_size, 1] float32 (read when FP8)
    page_table_ptr,  # [rows, width] int32
    kv_lens_ptr,  # [rows] int32
    out_ptr,  # [rows, width] float32 (width: the page table's, in keys)
    width,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_kp,
    stride_kt,
    stride_sp,
    stride_st,
    stride_table,
    stride_ot,
    PAGE_SIZE: tl.constexpr,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    DOT: tl.constexpr,  # tl.dot's operand dtype (dot_operands)
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, False)
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCK_N
    kv_len = tl.load(kv_lens_ptr + row)
    tok = first + tl.arange(0, BLOCK_N)
    ok = tok < kv_len  # a block past the row's end loads nothing (its loads masked)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < HEADS
    d_ok = d < DIM
    q = tl.load(
        q_ptr + row * stride_qt + h[:, None] * stride_qh + d[None, :],
        mask=h_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    w = tl.load(w_ptr + row * stride_wt + h, mask=h_ok, other=0.0)
    page = tl.load(page_table_ptr + row * stride_table + tok // PAGE_SIZE, mask=ok, other=0)
    page = page.to(tl.int64)
    at = keys_ptr + page * stride_kp + (tok % PAGE_SIZE) * stride_kt  # [BLOCK_N]
    k = tl.load(at[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    # [BLOCK_H, BLOCK_N]: every product exact (the module docstring), float32 sums
    logits = tl.dot(q.to(DOT), tl.trans(k.to(DOT)), input_precision=PRECISION)
    s = tl.sum(tl.maximum(logits * qk_scale, 0.0) * w[:, None], 0)  # [BLOCK_N]
    if FP8:
        at_s = kscale_ptr + page * stride_sp + (tok % PAGE_SIZE) * stride_st
        s = s * tl.load(at_s, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_ot + tok, tl.where(ok, s, float("-inf")), mask=tok < width)


def paged_index_scores(
    q: torch.Tensor,  # [rows, H, D] float32
    weights: torch.Tensor,  # [rows, H] float32
    keys: torch.Tensor,  # [pages, page_size, D]: index-K (model dtype, or float8_e4m3fn)
    key_scales: torch.Tensor | None,  # [pages, page_size, 1] float32: fp8 index-K's scales
    page_table: torch.Tensor,  # [rows, width] int32
    kv_lens: torch.Tensor,  # [rows] int32
    qk_scale: float,
) -> torch.Tensor:  # [rows, width * page_size] float32, -inf past each row's length
    """The module docstring's score of every row's keys (a padded row, kv_len 0: all -inf)."""
    rows, heads, dim = q.shape
    if (
        keys.dim() != 3
        or keys.shape[2] != dim
        or weights.shape != (rows, heads)
        or page_table.shape[0] != rows
        or kv_lens.shape != (rows,)
        or q.dtype != torch.float32
        or weights.dtype != torch.float32
        or q.stride(-1) != 1
        or weights.stride(-1) != 1
        or keys.stride(-1) != 1
        or (key_scales is not None and key_scales.shape[:2] != keys.shape[:2])
    ):
        raise ValueError(
            f"paged_index_scores: q {tuple(q.shape)} {q.dtype}, weights "
            f"{tuple(weights.shape)} {weights.dtype}, keys {tuple(keys.shape)}, page table "
            f"{tuple(page_table.shape)}, kv_lens {tuple(kv_lens.shape)}: wants float32 "
            "[rows, H, D] and [rows, H], keys [pages, page_size, D], unit stride in D"
        )
    page_size = keys.shape[1]
    width = page_table.shape[1] * page_size
    out = torch.empty(rows, width, dtype=torch.float32, device=q.device)
    if rows == 0 or width == 0:
        return out
    scales = key_scales if key_scales is not None else keys  # (not read without FP8)
    # fp8 keys (q then holds e4m3 values too) multiply as bf16, where both are exact
    dot = dot_dtype(torch.bfloat16 if key_scales is not None else keys.dtype, _index_scores_kernel)
    _index_scores_kernel[(rows, triton.cdiv(width, BLOCK_N))](
        q,
        weights,
        keys,
        scales,
        page_table,
        kv_lens,
        out,
        width,
        qk_scale,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        keys.stride(0),
        keys.stride(1),
        scales.stride(0),
        scales.stride(1),
        page_table.stride(0),
        out.stride(0),
        PAGE_SIZE=page_size,
        HEADS=heads,
        DIM=dim,
        BLOCK_H=block(heads),
        BLOCK_D=block(dim),
        BLOCK_N=BLOCK_N,
        FP8=key_scales is not None,
        DOT=dot,
        PRECISION=dot_precision(dot),
        **launch(q.device, _index_scores_kernel),
    )
    return out


def pick(
    scores: torch.Tensor,  # [rows, L] float32, -inf past each row's length
    kv_lens: torch.Tensor,  # [rows] int32
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([rows, min(topk, L)] int32 positions, [rows] int32)
    """Each row's `topk` best keys, ties to the lower position, in ascending position order
    (entries past a row's count are 0), and how many it has: min(topk, kv_len)."""
    if topk < 1:
        raise ValueError(f"index_topk must be >= 1, got {topk}")
    rows, length = scores.shape
    k = min(topk, length)
    positions = torch.arange(length, dtype=torch.int32, device=scores.device)
    valid = positions[None, :] < kv_lens[:, None]  # [rows, L]
    # NaN ranks highest, as in select's sort (a NaN score is a model fault: it then shows)
    ranked = scores.nan_to_num(nan=float("inf"), posinf=float("inf"))
    kth = ranked.topk(k, dim=-1).values[:, -1:]  # [rows, 1]: the k-th best score
    above = ranked > kth
    tied = ranked == kth
    room = k - above.sum(-1, keepdim=True, dtype=torch.int32)  # the tied keys that still fit
    chosen = (above | (tied & (tied.cumsum(-1, dtype=torch.int32) <= room))) & valid
    # The chosen positions, lowest first: each goes to its rank among the row's chosen keys
    # (a running count); the others go to a spill column k, cut off.
    rank = chosen.cumsum(-1, dtype=torch.int32) - 1
    slot = torch.where(chosen, rank, k).long()
    keys = torch.zeros(rows, k + 1, dtype=torch.int32, device=scores.device)
    keys.scatter_(1, slot, positions.expand(rows, length))
    return keys[:, :k], chosen.sum(-1, dtype=torch.int32)
