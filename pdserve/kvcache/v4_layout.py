"""DeepSeek-V4's KV as typed components: what is paged and what is per-request state.

V4's attention (model/deepseek_v4/attention.py) keeps, per layer:

* **Paged components**, one row per compressed entry, so `tokens_per_row` source tokens share
  a row and a page of `page_size` tokens holds `page_size / tokens_per_row` rows:
  - "csa.kv" [head_dim]: compressed sparse attention's entries, one per 4 tokens (CSA layers);
  - "csa.index_k" [index_head_dim]: its lightning indexer's compressed keys, one per 4 tokens;
  - "hca.kv" [head_dim]: heavily compressed attention's entries, one per 128 tokens (HCA layers).
  An entry is written once, when its window of source tokens closes, and never changes: a
  page of entries moves (PD, host tier) like any page of token rows.
  In fp8 mode (`--kv-dtype fp8`, `kv_dtype` below) an entry is stored in parts, DeepSeek's
  own recipe: "csa.kv"/"hca.kv" hold its first head_dim - rope_dim channels in float8_e4m3fn,
  "<name>_scale" one float32 scale per `KV_SCALE_BLOCK` of them (the last block may be
  shorter), "<name>_rope" its trailing rope_dim (rotated) channels in the model dtype; the
  indexer's keys "csa.index_k" are float8_e4m3fn whole, with one float32 scale a row in
  "csa.index_k_scale". The fp8 part keeps its component's name, so a peer of the other mode
  is refused naming it and both dtypes. The quantised values are the model's to make
  (model/deepseek_v4/kv_quant.py): a store never casts floats to fp8.
* **Each page's state at its end**, one row per page (tokens_per_row = page_size), written as
  the page completes: "swa.page_ring" [sliding_window, head_dim] (K=V of its last tokens) and
  CSA's overlap there ("csa.page_overlap_kv"/"_gate", "csa.page_index_overlap_kv"/"_gate");
  every tail is empty at a page boundary. A request that resumes from a cached prefix rebuilds
  its state slot from its last cached page's row (the prefix cache, the host tier).
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
The per-request state is the same in either mode.
"""

from __future__ import annotations

import math
from typing import Protocol

from pdserve.kvcache.buffer_spec import BufferSpec, StateSpec, check_int

__all__ = [
    "KV_DTYPES",
    "KV_SCALE_BLOCK",
    "StateSpec",
    "V4Shape",
    "layers_of",
    "rope_of",
    "scale_of",
    "v4_buffers",
    "v4_page_size",
    "v4_state",
]

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

CSA_KV, CSA_INDEX_K, HCA_KV = "csa.kv", "csa.index_k", "hca.kv"
SWA_RING = "swa.ring"
CSA_TAIL_KV, CSA_TAIL_GATE = "csa.tail_kv", "csa.tail_gate"
CSA_OVERLAP_KV, CSA_OVERLAP_GATE = "csa.overlap_kv", "csa.overlap_gate"
INDEX_TAIL_KV, INDEX_TAIL_GATE = "csa.index_tail_kv", "csa.index_tail_gate"
INDEX_OVERLAP_KV, INDEX_OVERLAP_GATE = "csa.index_overlap_kv", "csa.index_overlap_gate"
HCA_TAIL_KV, HCA_TAIL_GATE = "hca.tail_kv", "hca.tail_gate"
# A page's state at its end (one row per page), from which a request resuming there from the
# prefix cache rebuilds its slot: the ring's rows, CSA's overlap (tails are empty there).
PAGE_RING = "swa.page_ring"
PAGE_OVERLAP_KV, PAGE_OVERLAP_GATE = "csa.page_overlap_kv", "csa.page_overlap_gate"
PAGE_INDEX_OVERLAP_KV = "csa.page_index_overlap_kv"
PAGE_INDEX_OVERLAP_GATE = "csa.page_index_overlap_gate"

KV_DTYPES = ("auto", "fp8")  # --kv-dtype: the paged components in the model dtype, or fp8
FP8 = "float8_e4m3fn"
# Channels an entry's fp8 part shares one scale over: DeepSeek's reference quantises the
# non-rotary part of its KV in blocks of 64 (its `act_quant(kv[..., :-rd], 64, ...)`).
KV_SCALE_BLOCK = 64


def scale_of(name: str) -> str:
    """The fp8 component `name`'s scales ("csa.kv" -> "csa.kv_scale")."""
    return f"{name}_scale"


def rope_of(name: str) -> str:
    """The fp8 entry component `name`'s rotary part, kept in the model dtype."""
    return f"{name}_rope"


class RotaryWidth(Protocol):
    @property
    def dim(self) -> int: ...  # the rotated trailing channels of a head


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
    @property
    def compress_rope(self) -> RotaryWidth: ...  # the entries' and indexer keys' rotary part


def layers_of(shape: V4Shape, kind: str) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(shape.layer_types) if t == kind)


def v4_page_size(shape: V4Shape, asked: int) -> int:
    """The page size V4 uses: the smallest multiple of `asked` that holds whole windows of
    both ratios (a page's rows of entries are its own tokens' windows; kvcache/pool.py) and
    the sliding window (a page's end keeps its last window of tokens)."""
    size = asked
    for ratio in (shape.csa_ratio, shape.hca_ratio):
        size = math.lcm(size, ratio)
    return -(-shape.sliding_window // size) * size  # and at least a window: its page ends


def v4_buffers(
    shape: V4Shape, dtype: str, page_size: int, kv_dtype: str = "auto", page_ends: bool = True
) -> tuple[BufferSpec, ...]:
    """The paged components: the entries in the model's `dtype` ("auto"), or split into fp8
    parts and their scales ("fp8"; the module's header); then each page's state at its end
    (a row per page: the model's dtype, the overlap's biased gates float32), in both modes,
    where a prefix cache may resume there (`page_ends`): for V4-Flash's shape they are most
    of a page's bytes."""
    csa, hca = layers_of(shape, CSA), layers_of(shape, HCA)
    c = shape.csa_ratio
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"KV dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    if shape.sliding_window > page_size:
        raise ValueError(
            f"a sliding window of {shape.sliding_window} tokens needs pages of at least as many"
        )
    out = list(_entries(shape, dtype, kv_dtype, csa, hca))
    if not page_ends:  # no prefix cache: nothing ever resumes at a page's end
        return tuple(out)
    d, di = shape.head_dim, shape.index_head_dim
    out.append(BufferSpec(PAGE_RING, (shape.sliding_window, d), dtype, None, page_size))
    if csa:
        out += [
            BufferSpec(PAGE_OVERLAP_KV, (c, d), dtype, csa, page_size),
            BufferSpec(PAGE_OVERLAP_GATE, (c, d), "float32", csa, page_size),
            BufferSpec(PAGE_INDEX_OVERLAP_KV, (c, di), dtype, csa, page_size),
            BufferSpec(PAGE_INDEX_OVERLAP_GATE, (c, di), "float32", csa, page_size),
        ]
    return tuple(out)


def _entries(
    shape: V4Shape, dtype: str, kv_dtype: str, csa: tuple[int, ...], hca: tuple[int, ...]
) -> list[BufferSpec]:
    """The compressed entries' buffers in `kv_dtype`'s mode."""
    c, h = shape.csa_ratio, shape.hca_ratio
    out: list[BufferSpec] = []
    if kv_dtype == "auto":
        if csa:
            out.append(BufferSpec(CSA_KV, (shape.head_dim,), dtype, csa, c))
            out.append(BufferSpec(CSA_INDEX_K, (shape.index_head_dim,), dtype, csa, c))
        if hca:
            out.append(BufferSpec(HCA_KV, (shape.head_dim,), dtype, hca, h))
        return out
    rope = shape.compress_rope.dim
    nope = shape.head_dim - rope
    if nope < 1:
        raise ValueError(
            f"fp8 KV quantises the channels before the rotary part, but all {shape.head_dim} "
            "of a head rotate"
        )
    blocks = -(-nope // KV_SCALE_BLOCK)

    def entry(name: str, layers: tuple[int, ...], ratio: int) -> list[BufferSpec]:
        return [
            BufferSpec(name, (nope,), FP8, layers, ratio),
            BufferSpec(scale_of(name), (blocks,), "float32", layers, ratio),
            BufferSpec(rope_of(name), (rope,), dtype, layers, ratio),
        ]

    if csa:
        out += entry(CSA_KV, csa, c)
        out.append(BufferSpec(CSA_INDEX_K, (shape.index_head_dim,), FP8, csa, c))
        out.append(BufferSpec(scale_of(CSA_INDEX_K), (1,), "float32", csa, c))
    if hca:
        out += entry(HCA_KV, hca, h)
    return out


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
