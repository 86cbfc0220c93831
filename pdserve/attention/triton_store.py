"""The KV store kernel: a step's new K/V into their pool slots, in the pool's dtype.

One program per new token writes that token's K and V ([kv_heads, head_dim] each) into slot
`slot_mapping[t]` (page * page_size + offset) of one layer's pool views, addressed through
the views' own strides (a layer's cache is strided across pages: a page holds every layer).
A negative slot is skipped: the padded rows of a CUDA-graph bucket have slot -1 and write
nothing. The grid is the number of token rows, so a captured graph replays it unchanged.

`rope_store_kv` is the same store with RoPE in front (kernels/triton_fused's rotary math, so
the same bits): the program also rotates its token's query heads in place and its key heads,
which it writes back in place and to the pool. One kernel instead of two a layer: at batch 1
a launch inside a CUDA graph costs about as much as the work of either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.attention.triton_common import block, check_cache
from pdserve.kernels.pdl import enter, launch
from pdserve.kernels.triton_fused import rope_halves, rotate_heads

# PDL (kernels/pdl.py): the two store kernels do not let the next kernel launch early. In a
# decode step the next is decode attention, whose blocks (four a SM at batch 32) placed beside
# this kernel's would no longer all fit in one wave, which slows a batch-32 step
# (benchmarks/RESULTS.md, 2026-12-02 third session). (In a prefill step the next is prefill
# attention: no matter.)


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
    PDL: tl.constexpr,
):
    enter(PDL, False)  # the next kernel is decode attention: see the note above
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
        **launch(k.device, _store_kv_kernel),
    )


@triton.jit
def _rope_store_kv_kernel(
    q_ptr,  # [T, Hq, D]: rotated in place
    k_ptr,  # [T, Hkv, D]: rotated in place, then stored
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [pages, page_size, Hkv, D]
    v_cache_ptr,
    slot_ptr,  # [T] int32; < 0: rotate, store nothing
    pos_ptr,  # [T]
    inv_freq_ptr,  # [D / 2] float32
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
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
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, False)  # the next kernel is decode attention: see the note above
    t = tl.program_id(0).to(tl.int64)
    half = HEAD_DIM // 2
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < half
    freq = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + i, mask=i_ok, other=0.0)
    q_base = q_ptr + t * stride_qt
    rotate_heads(q_base, stride_qh, Q_HEADS, freq, i_ok, half, BLOCK_QH, BLOCK_HALF)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    h = tl.arange(0, BLOCK_H)
    h_ok = h[:, None] < KV_HEADS
    k_lo = k_ptr + t * stride_kt + h[:, None] * stride_kh + i[None, :]  # unit stride along D
    k_mask = h_ok & i_ok[None, :]
    k1, k2 = rope_halves(
        tl.load(k_lo, mask=k_mask, other=0.0), tl.load(k_lo + half, mask=k_mask, other=0.0), freq
    )
    tl.store(k_lo, k1, mask=k_mask)
    tl.store(k_lo + half, k2, mask=k_mask)
    k_dst = k_cache_ptr + page * stride_ckp + offset * stride_ckt
    k_dst += h[:, None] * stride_ckh + i[None, :] * stride_ckd
    stored = k_mask & (slot >= 0)
    cache_dtype = k_cache_ptr.dtype.element_ty
    tl.store(k_dst, k1.to(cache_dtype), mask=stored)
    tl.store(k_dst + half * stride_ckd, k2.to(cache_dtype), mask=stored)

    d = tl.arange(0, BLOCK_D)
    v_mask = h_ok & (d[None, :] < HEAD_DIM) & (slot >= 0)
    v = tl.load(
        v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=v_mask
    )
    v_dst = v_cache_ptr + page * stride_cvp + offset * stride_cvt
    v_dst += h[:, None] * stride_cvh + d[None, :] * stride_cvd
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def rope_store_kv(
    q: torch.Tensor,  # [T, Hq, D], unit stride along D
    k: torch.Tensor,  # [T, Hkv, D], unit stride along D
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [pages, page_size, Hkv, D]: one layer's pool view
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int32
    positions: torch.Tensor,  # [T]
    inv_freq: torch.Tensor,  # [D / 2] float32
) -> None:
    """kernels/triton_fused.rotary(q, k, positions, inv_freq) (in place), then
    store_kv(k, v, ...), as one kernel."""
    check_cache(k_cache, "k_cache")
    check_cache(v_cache, "v_cache")
    t, heads, dim = k.shape
    if (
        v.shape != k.shape
        or q.shape[0] != t
        or q.shape[2] != dim
        or dim % 2
        or slot_mapping.shape != (t,)
        or positions.shape != (t,)
        or inv_freq.shape != (dim // 2,)
        or k_cache.shape[2:] != (heads, dim)
        or q.stride(-1) != 1
        or k.stride(-1) != 1
    ):
        raise ValueError(
            f"rope_store_kv: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"slots {tuple(slot_mapping.shape)}, positions {tuple(positions.shape)}, inv_freq "
            f"{tuple(inv_freq.shape)} do not fit a cache of {tuple(k_cache.shape)} "
            "(q and k need unit stride along the head dim)"
        )
    if t == 0:
        return
    _rope_store_kv_kernel[(t,)](
        q,
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        positions,
        inv_freq,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        PAGE_SIZE=k_cache.shape[1],
        Q_HEADS=q.shape[1],
        KV_HEADS=heads,
        HEAD_DIM=dim,
        BLOCK_QH=block(q.shape[1], 1),
        BLOCK_H=block(heads, 1),
        BLOCK_D=block(dim, 1),
        BLOCK_HALF=block(dim // 2, 1),
        **launch(q.device, _rope_store_kv_kernel),
    )


@triton.jit
def _store_rows_kernel(
    x_ptr,  # [T, H, D]: new rows
    cache_ptr,  # [pages, page_size, H, D]
    slot_ptr,  # [T] int32; < 0: skip
    stride_xt,
    stride_xh,
    stride_xd,
    stride_cp,
    stride_ct,
    stride_ch,
    stride_cd,
    PAGE_SIZE: tl.constexpr,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, False)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < HEADS) & (d[None, :] < DIM) & (slot >= 0)
    x = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :] * stride_xd, mask=mask)
    dst = cache_ptr + (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_ct
    dst += h[:, None] * stride_ch + d[None, :] * stride_cd
    tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


def store_rows(
    x: torch.Tensor,  # [T, H, D]
    cache: torch.Tensor,  # [pages, page_size, H, D]: one layer's view of one pool buffer
    slot_mapping: torch.Tensor,  # [T] int32: a slot, or < 0 to skip the row
) -> None:
    """`store_kv` for one buffer (a latent pool's rows): row t of x into slot
    `slot_mapping[t]` of `cache`, converted to its dtype; rows with a negative slot write
    nothing (a CUDA-graph bucket's padding)."""
    check_cache(cache, "cache")
    t, heads, dim = x.shape
    if slot_mapping.shape != (t,) or cache.shape[2:] != (heads, dim):
        raise ValueError(
            f"store_rows: rows {tuple(x.shape)}, slots {tuple(slot_mapping.shape)} do not fit "
            f"a cache of {tuple(cache.shape)}"
        )
    if t == 0:
        return
    _store_rows_kernel[(t,)](
        x,
        cache,
        slot_mapping,
        *x.stride(),
        *cache.stride(),
        PAGE_SIZE=cache.shape[1],
        HEADS=heads,
        DIM=dim,
        BLOCK_H=block(heads, 1),
        BLOCK_D=block(dim, 1),
        **launch(x.device, _store_rows_kernel),
    )
