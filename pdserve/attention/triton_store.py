"""The KV store kernel: a step's new K/V into their pool slots, in the pool's dtype.

One program per new token writes that token's K and V ([kv_heads, head_dim] each) into slot
`slot_mapping[t]` (page * page_size + offset) of one layer's pool views, addressed through
the views' own strides (a layer's cache is strided across pages: a page holds every layer).
A negative slot is skipped: the padded rows of a CUDA-graph bucket have slot -1 and write
nothing. The grid is the number of token rows, so a captured graph replays it unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.attention.triton_common import block, check_cache


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, Hkv, D]: new keys
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [pages, page_size, Hkv, D]
    v_cache_ptr,
    slot_ptr,  # [T] int32; < 0: skip
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ckp,
    stride_ckt,
    stride_ckh,
    stride_ckd,
    stride_cvp,
    stride_cvt,
    stride_cvh,
    stride_cvd,
    PAGE_SIZE: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < KV_HEADS) & (d[None, :] < HEAD_DIM) & (slot >= 0)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
    k_dst = k_cache_ptr + page * stride_ckp + offset * stride_ckt
    v_dst = v_cache_ptr + page * stride_cvp + offset * stride_cvt
    k_dst += h[:, None] * stride_ckh + d[None, :] * stride_ckd
    v_dst += h[:, None] * stride_cvh + d[None, :] * stride_cvd
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [pages, page_size, Hkv, D]: one layer's pool view
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int32: a slot, or < 0 to skip the row
) -> None:
    """Write row t of k and v into slot `slot_mapping[t]` of the caches, converted to their
    dtype; rows with a negative slot write nothing."""
    check_cache(k_cache, "k_cache")
    check_cache(v_cache, "v_cache")
    t, heads, dim = k.shape
    if v.shape != k.shape or slot_mapping.shape != (t,) or k_cache.shape[2:] != (heads, dim):
        raise ValueError(
            f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, slots "
            f"{tuple(slot_mapping.shape)} do not fit a cache of {tuple(k_cache.shape)}"
        )
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        PAGE_SIZE=k_cache.shape[1],
        KV_HEADS=heads,
        HEAD_DIM=dim,
        BLOCK_H=block(heads, 1),
        BLOCK_D=block(dim, 1),
    )
