"""DeepSeek-V4's KV as typed components: what is paged and what is per-request state.

V4's attention (model/deepseek_v4/attention.py) keeps, per layer:

* **Paged components**, one row per compressed entry, so `tokens_per_row` source tokens share
  a row and a page of `page_size` tokens holds `page_size / tokens_per_row` rows:
  - "csa.kv" [head_dim]: compressed sparse attention's entries, one per 4 tokens (CSA layers);
  - "csa.index_k" [index_head_dim]: its lightning indexer's compressed keys, one per 4 tokens;
  - "hca.kv" [head_dim]: heavily compressed attention's entries, one per 128 tokens (HCA layers).
  An entry is written once, when its window of source tokens closes, and never changes: a
  page of entries moves (PD, host tier) like any page of token rows.
* **Per-request state** (`StateSpec`), one slot per running request, rewritten every step:
  - "swa.ring" [sliding_window, head_dim]: the uncompressed K=V of the last `sliding_window`
    tokens, row `position % sliding_window` (every layer);
  - a compressor's tail: the projected kv and gate of the tokens after the last closed window
    (row `position % ratio`; at most ratio - 1 rows), "csa.tail_kv"/"csa.tail_gate"
    [3, 2 * head_dim], "csa.index_tail_kv"/"csa.index_tail_gate" [3, 2 * index_head_dim],
    "hca.tail_kv"/"hca.tail_gate" [127, head_dim];
  - CSA's overlap: the last closed window's first series (Ca) and its biased gate, which the
    next window's entry mixes in: "csa.overlap_kv" [4, head_dim] (model dtype) and
    "csa.overlap_gate" [4, head_dim] (float32: the gate after its float32 position bias),
    likewise "csa.index_overlap_kv"/"csa.index_overlap_gate" [4, index_head_dim].
  Which rows of a slot hold data follows from the request's position alone (tokens computed):
  the model never reads a row it has not written for this request, so a slot needs no zeroing.

The ratios and sizes come from the model's config (`V4Shape`); the names above are fixed.
"""

from __future__ import annotations

import math
from typing import Protocol

from pdserve.kvcache.buffer_spec import BufferSpec, StateSpec, check_int

__all__ = ["StateSpec", "V4Shape", "layers_of", "v4_buffers", "v4_page_size", "v4_state"]

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

CSA_KV, CSA_INDEX_K, HCA_KV = "csa.kv", "csa.index_k", "hca.kv"
SWA_RING = "swa.ring"
CSA_TAIL_KV, CSA_TAIL_GATE = "csa.tail_kv", "csa.tail_gate"
CSA_OVERLAP_KV, CSA_OVERLAP_GATE = "csa.overlap_kv", "csa.overlap_gate"
INDEX_TAIL_KV, INDEX_TAIL_GATE = "csa.index_tail_kv", "csa.index_tail_gate"
INDEX_OVERLAP_KV, INDEX_OVERLAP_GATE = "csa.index_overlap_kv", "csa.index_overlap_gate"
HCA_TAIL_KV, HCA_TAIL_GATE = "hca.tail_kv", "hca.tail_gate"


class V4Shape(Protocol):
    """What the layout needs of a DeepSeek-V4 config (model/deepseek_v4/config.py has it)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def layer_types(self) -> tuple[str, ...]: ...  # SWA, CSA or HCA per layer
    @property
    def head_dim(self) -> int: ...
    @property
    def index_head_dim(self) -> int: ...
    @property
    def sliding_window(self) -> int: ...
    @property
    def csa_ratio(self) -> int: ...  # compress_rates[CSA]
    @property
    def hca_ratio(self) -> int: ...  # compress_rates[HCA]


def layers_of(shape: V4Shape, kind: str) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(shape.layer_types) if t == kind)


def v4_page_size(shape: V4Shape, asked: int) -> int:
    """The page size V4 uses: the smallest multiple of `asked` that holds whole windows of
    both ratios (a page's rows of entries are its own tokens' windows; kvcache/pool.py)."""
    size = asked
    for ratio in (shape.csa_ratio, shape.hca_ratio):
        size = math.lcm(size, ratio)
    return size


def v4_buffers(shape: V4Shape, dtype: str) -> tuple[BufferSpec, ...]:
    """The paged components (bf16/f32 layout: every one in the model's dtype)."""
    csa, hca = layers_of(shape, CSA), layers_of(shape, HCA)
    out: list[BufferSpec] = []
    if csa:
        out.append(BufferSpec(CSA_KV, (shape.head_dim,), dtype, csa, shape.csa_ratio))
        out.append(BufferSpec(CSA_INDEX_K, (shape.index_head_dim,), dtype, csa, shape.csa_ratio))
    if hca:
        out.append(BufferSpec(HCA_KV, (shape.head_dim,), dtype, hca, shape.hca_ratio))
    return tuple(out)


def v4_state(shape: V4Shape, dtype: str) -> tuple[StateSpec, ...]:
    """The per-request state components, in the model's dtype except the overlap gates."""
    d, di = shape.head_dim, shape.index_head_dim
    c = check_int("csa_ratio", shape.csa_ratio, 1, 1 << 12)
    h = check_int("hca_ratio", shape.hca_ratio, 1, 1 << 12)
    out = [StateSpec(SWA_RING, (shape.sliding_window, d), dtype, tuple(range(shape.num_layers)))]
    csa, hca = layers_of(shape, CSA), layers_of(shape, HCA)
    if csa:
        if c > 1:
            out += [
                StateSpec(CSA_TAIL_KV, (c - 1, 2 * d), dtype, csa),
                StateSpec(CSA_TAIL_GATE, (c - 1, 2 * d), dtype, csa),
                StateSpec(INDEX_TAIL_KV, (c - 1, 2 * di), dtype, csa),
                StateSpec(INDEX_TAIL_GATE, (c - 1, 2 * di), dtype, csa),
            ]
        out += [
            StateSpec(CSA_OVERLAP_KV, (c, d), dtype, csa),
            StateSpec(CSA_OVERLAP_GATE, (c, d), "float32", csa),
            StateSpec(INDEX_OVERLAP_KV, (c, di), dtype, csa),
            StateSpec(INDEX_OVERLAP_GATE, (c, di), "float32", csa),
        ]
    if hca and h > 1:
        out += [
            StateSpec(HCA_TAIL_KV, (h - 1, d), dtype, hca),
            StateSpec(HCA_TAIL_GATE, (h - 1, d), dtype, hca),
        ]
    return tuple(out)
