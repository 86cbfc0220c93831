"""Paged attention over the KV pool, in plain torch (runs on CPU and CUDA).

Invariants: the runner lays a step's tokens out flat with the decode tokens first (one per
sequence) and the prefill chunks after them. Every index tensor here is computed once per
step by the runner and shared by all layers; a layer only scatters its new K/V into the pool
and gathers what each query may see. Keys are gathered a page at a time (`index_select` on
the page dimension copies page_size * kv_heads * head_dim contiguous values per index), not a
slot at a time: on a CPU the per-slot gather was most of a decode step's attention.
Decode rows are grouped by KV length (the runner's `group_by_length`) so that one long
sequence does not pad every short one in the batch to its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    """One prefill chunk: queries q[q_start : q_start+q_len] see the first kv_len keys held
    in kv_pages (context + chunk). A chunk that is the whole context has neither pages nor
    mask: it attends to its own fresh K/V, causally."""

    q_start: int
    q_len: int
    kv_pages: torch.Tensor | None = None  # [ceil(kv_len / page_size)] long, in order
    mask: torch.Tensor | None = None  # [q_len, kv_len] bool: True = visible


@dataclass
class DecodeGroup:
    """Decode rows of similar KV length, attended in one padded batch."""

    rows: torch.Tensor | None  # [n] long: which of the step's decode tokens; None = all, in order
    pages: torch.Tensor  # [n, max_pages] long (padded with page 0)
    mask: torch.Tensor  # [n, 1, 1, max_pages * page_size] bool: True = visible


@dataclass
class AttentionContext:
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V is written
    num_decode: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSeq] = field(default_factory=list)


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache [num_pages, page_size, Hkv, D] at pages [..., n] -> [..., n * page_size, Hkv, D]."""
    out = cache.index_select(0, pages.reshape(-1))
    return out.view(*pages.shape[:-1], pages.shape[-1] * cache.shape[1], *cache.shape[2:])


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    ctx: AttentionContext,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    hkv = k.shape[1]
    # A layer's cache is strided across pages (the pool keeps a page of all layers together),
    # so a flat slot s is addressed as (s // page_size, s % page_size).
    ps = k_cache.shape[1]
    new = (ctx.slot_mapping // ps, ctx.slot_mapping % ps)
    k_cache[new] = k.to(k_cache.dtype)
    v_cache[new] = v.to(v_cache.dtype)
    gqa = q.shape[1] != hkv

    out = torch.empty_like(q)
    b = ctx.num_decode
    for g in ctx.decode_groups:
        kd = gather_pages(k_cache, g.pages).transpose(1, 2)  # [n, Hkv, max_kv, D]
        vd = gather_pages(v_cache, g.pages).transpose(1, 2)
        qd = (q[:b] if g.rows is None else q[g.rows]).unsqueeze(2)  # [n, Hq, 1, D]
        od = F.scaled_dot_product_attention(  # [n, Hq, D]
            qd, kd.to(q.dtype), vd.to(q.dtype), attn_mask=g.mask, scale=scale, enable_gqa=gqa
        ).squeeze(2)
        if g.rows is None:
            out[:b] = od
        else:
            out[g.rows] = od
    for p in ctx.prefills:
        # 4-D [1, heads, len, D]: torch's CPU flash kernel takes only batched inputs and sends
        # 3-D ones to the unfused math path, several times slower on a long chunk.
        sl = slice(p.q_start, p.q_start + p.q_len)
        qp = q[sl].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        if p.kv_pages is None or p.mask is None:
            kp, vp = k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None]
            op = F.scaled_dot_product_attention(  # [1, Hq, q_len, D]
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            kv_len = p.mask.shape[1]
            kp = gather_pages(k_cache, p.kv_pages)[:kv_len].transpose(0, 1)[None].to(q.dtype)
            vp = gather_pages(v_cache, p.kv_pages)[:kv_len].transpose(0, 1)[None].to(q.dtype)
            op = F.scaled_dot_product_attention(  # [1, Hq, q_len, D]
                qp, kp, vp, attn_mask=p.mask, scale=scale, enable_gqa=gqa
            )
        out[sl] = op[0].transpose(0, 1)
    return out
