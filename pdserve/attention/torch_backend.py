"""The `torch` attention backend: paged attention in plain torch SDPA (CPU and CUDA).

The reference backend: every other backend is checked against it, and it is checked against
a slot-by-slot float64 reference (tests/engine/test_runner.py).

Invariants: `prepare` derives everything from the Batch on the device, without a device read
and without a copy of its own (the Batch's staged upload is the step's only one); every layer
then reuses it. Keys are gathered a page at a time (`index_select` on the page dimension
copies page_size * kv_heads * head_dim contiguous values per index), not a slot at a time: on
a CPU the per-slot gather was most of a decode step's attention. Decode rows are grouped by KV
length (`group_by_length`) so that one long sequence does not pad every short one to its
length; a group's rows are a slice of the decode rows stably sorted by page count, computed on
the device by the same rule the host uses to size the groups.

Any other buffer of the layout (DeepSeek's "latent") is served by the generic pair: `store`
writes a step's tokens into their slots, `gather` reads each sequence's first kv_len tokens a
page at a time through the Batch's page table (`CausalIndex`, computed once per step in
`prepare` when the layout has such a buffer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.attention.backend import AttentionShape, CausalContext, Rope
from pdserve.attention.batch import Batch, CausalIndex, causal_index
from pdserve.attention.v4_kv import Journal, PoolStepKV, undo
from pdserve.kvcache.pool import KVPool

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def group_by_length(kv_lens: Sequence[int], page_size: int) -> list[list[int]]:
    """Decode rows in groups, longest first, each holding every remaining row with more than
    half the pages of the group's longest: padding a row to its group's length at most doubles
    its attention work, where one batch padded to the longest row could multiply it by 10.
    Rows are in stable order of descending page count, so the groups are consecutive slices
    of that order.
    """
    pages = [-(-n // page_size) for n in kv_lens]
    order = sorted(range(len(kv_lens)), key=lambda i: -pages[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and 2 * pages[i] > pages[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows of similar KV length, attended in one padded batch."""

    rows: torch.Tensor | None  # [n]: which of the step's decode tokens; None = all, in order
    pages: torch.Tensor  # [n, max_pages] contiguous (padded with page 0)
    mask: torch.Tensor  # [n, 1, 1, max_pages * page_size] bool: True = visible


@dataclass(frozen=True)
class PrefillSpan:
    """One prefill chunk: queries q[q_start : q_start+q_len] see the first kv_len keys held
    in `pages` (context + chunk). A chunk that is its sequence's whole context has neither
    pages nor mask: it attends to its own fresh K/V, causally."""

    q_start: int
    q_len: int
    pages: torch.Tensor | None = None  # [pages_needed(kv_len)], in token order
    mask: torch.Tensor | None = None  # [q_len, kv_len] bool: True = visible


@dataclass(frozen=True)
class TorchMetadata:
    new_slots: tuple[torch.Tensor, torch.Tensor]  # ([T] page, [T] offset) of each new token
    num_decodes: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    causal: CausalIndex | None = None  # for `gather`: a layout with buffers beyond k and v
    batch: Batch | None = None  # for `step_kv`: a pool with per-request state (DeepSeek-V4)


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache [num_pages, page_size, Hkv, D] at pages [..., n] -> [..., n * page_size, Hkv, D]."""
    out = cache.index_select(0, pages.reshape(-1))
    return out.view(*pages.shape[:-1], pages.shape[-1] * cache.shape[1], *cache.shape[2:])


class TorchBackend:
    name = "torch"

    def __init__(self, pool: KVPool, shape: AttentionShape) -> None:
        self.pool = pool
        names = {b.name for b in pool.layout.buffers}
        self.kv = (
            [pool.layer(i) for i in range(pool.layout.num_layers)] if {"k", "v"} <= names else []
        )
        self.generic = not names <= {"k", "v"}  # a buffer only `store`/`gather` serve
        self._views: dict[tuple[int, str], torch.Tensor] = {}
        self._journal: Journal = []  # the current step's state writes (DeepSeek-V4)
        self.page_size = pool.page_size
        self.scale = shape.head_dim**-0.5
        self.gqa = shape.num_heads != shape.num_kv_heads

    def prepare(self, batch: Batch) -> TorchMetadata:
        ps = batch.page_size
        # A layer's cache is strided across pages (the pool keeps a page of all layers
        # together), so a flat slot s is addressed as (s // page_size, s % page_size). In
        # int64 once here: advanced indexing would convert int32 indices in every layer.
        slots = batch.slot_mapping.long()  # [T]
        new_slots = (slots // ps, slots % ps)
        nd = batch.num_decodes
        if self.pool.state is not None:  # DeepSeek-V4: only `step_kv` can be asked for
            return TorchMetadata(new_slots, nd, [], [], None, batch)
        if not self.kv:  # no k/v buffers: only the generic pair can be asked for
            return TorchMetadata(new_slots, nd, [], [], causal_index(batch))
        groups = []
        if nd:
            by_length = group_by_length(batch.host_kv_lens[:nd], ps)
            if len(by_length) == 1:  # every row, in step order: no index to gather or scatter by
                groups.append(self._decode_group(batch, None, max(batch.host_kv_lens[:nd])))
            else:
                pages = (batch.kv_lens[:nd] + ps - 1) // ps  # [nd]
                order = torch.sort(-pages, stable=True).indices  # [nd]: group_by_length's order
                first = 0
                for g in by_length:
                    rows = order[first : first + len(g)]
                    groups.append(self._decode_group(batch, rows, batch.host_kv_lens[g[0]]))
                    first += len(g)
        prefills = []
        for b in range(nd, batch.num_seqs):
            q_start, q_len = batch.host_query_start[b], batch.host_query_len(b)
            kv_len = batch.host_kv_lens[b]
            if kv_len == q_len:
                prefills.append(PrefillSpan(q_start, q_len))
                continue
            device = batch.positions.device
            q_pos = batch.positions[q_start : q_start + q_len]  # [q_len]
            mask = torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]
            pages = batch.page_table[b, : -(-kv_len // ps)]
            prefills.append(PrefillSpan(q_start, q_len, pages, mask))
        causal = causal_index(batch) if self.generic else None
        return TorchMetadata(new_slots, nd, groups, prefills, causal)

    def _decode_group(self, batch: Batch, rows: torch.Tensor | None, longest: int) -> DecodeGroup:
        """The decode rows `rows` (None: all of them, in order), the longest of `longest` keys."""
        nd, ps = batch.num_decodes, batch.page_size
        width = -(-longest // ps)
        table = batch.page_table[:nd] if rows is None else batch.page_table[rows]
        kv_lens = batch.kv_lens[:nd] if rows is None else batch.kv_lens[rows]
        pos = torch.arange(width * ps, device=kv_lens.device)
        mask = (pos[None, :] < kv_lens[:, None])[:, None, None, :]
        return DecodeGroup(rows, table[:, :width].contiguous(), mask)

    def store_kv(
        self,
        layer: int,
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        metadata: TorchMetadata,
    ) -> None:
        k_cache, v_cache = self.kv[layer]
        k_cache[metadata.new_slots] = k.to(k_cache.dtype)
        v_cache[metadata.new_slots] = v.to(v_cache.dtype)

    def rope_store_kv(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        rope: Rope,
        metadata: TorchMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = rope.apply(q, k)
        self.store_kv(layer, k, v, metadata)
        return q, k

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        metadata: TorchMetadata,
    ) -> torch.Tensor:  # [T, Hq, D]
        k_cache, v_cache = self.kv[layer]
        scale, gqa = self.scale, self.gqa
        out = torch.empty_like(q)
        b = metadata.num_decodes
        for g in metadata.decode_groups:
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
        for p in metadata.prefills:
            # 4-D [1, heads, len, D]: torch's CPU flash kernel takes only batched inputs and
            # sends 3-D ones to the unfused math path, several times slower on a long chunk.
            sl = slice(p.q_start, p.q_start + p.q_len)
            qp = q[sl].transpose(0, 1)[None]  # [1, Hq, q_len, D]
            if p.pages is None or p.mask is None:
                kp, vp = k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None]
                op = F.scaled_dot_product_attention(  # [1, Hq, q_len, D]
                    qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa
                )
            else:
                kv_len = p.mask.shape[1]
                kp = gather_pages(k_cache, p.pages)[:kv_len].transpose(0, 1)[None].to(q.dtype)
                vp = gather_pages(v_cache, p.pages)[:kv_len].transpose(0, 1)[None].to(q.dtype)
                op = F.scaled_dot_product_attention(  # [1, Hq, q_len, D]
                    qp, kp, vp, attn_mask=p.mask, scale=scale, enable_gqa=gqa
                )
            out[sl] = op[0].transpose(0, 1)
        return out

    # -- DeepSeek-V4 (model/deepseek_v4/kv.py V4KVBackend) ---------------------------------
    def step_kv(self, metadata: TorchMetadata) -> PoolStepKV:
        """The step's compressed entries and state slots, as V4's attention reads them."""
        if metadata.batch is None:
            raise ValueError("step_kv: this KV pool keeps no per-request state")
        self._journal = []  # a new step: the last one's writes stand
        return PoolStepKV(self.pool, metadata.batch, self._journal)

    def undo_state(self) -> None:
        """Undo the state writes of the step since the last `step_kv` (it failed)."""
        undo(self._journal)

    # -- the generic pair (attention/backend.py GatherBackend) ------------------------------
    def _view(self, layer: int, name: str) -> torch.Tensor:
        """[num_pages, page_size, *shape] of buffer `name` in `layer` (KeyError if absent)."""
        key = (layer, name)
        if key not in self._views:
            self._views[key] = self.pool.view(layer, name)
        return self._views[key]

    def store(
        self,
        layer: int,
        name: str,
        values: torch.Tensor,  # [T, *shape]
        metadata: TorchMetadata,
    ) -> None:
        view = self._view(layer, name)
        if view.dtype in FP8 and values.dtype != view.dtype:
            raise ValueError(
                f"store of {values.dtype} values into {view.dtype} buffer {name!r} (layer "
                f"{layer}): quantise them first (a plain cast has no scale)"
            )
        view[metadata.new_slots] = values.to(view.dtype)

    def buffer_dtype(self, layer: int, name: str) -> torch.dtype:
        return self._view(layer, name).dtype

    def gather(self, layer: int, name: str, metadata: TorchMetadata) -> CausalContext:
        if metadata.causal is None:
            raise ValueError(f"gather of {name!r}: the KV layout has only k and v buffers")
        index = metadata.causal
        values = gather_pages(self._view(layer, name), index.pages)  # [B, pages * ps, *shape]
        return CausalContext(values[:, : index.max_kv_len], index)
