"""DeepSeek-V4's compressed KV in fp8 (`--kv-dtype fp8`): the model quantises its entries as it
stores them and dequantises them as it reads them back; the pool only holds the bytes.

The layout decides the mode (kvcache/v4_layout.py): where a paged component is stored as
float8_e4m3fn, `store_rows` splits each row as that layout says, and where it is not, rows
pass through in the model dtype (HF parity). A row of `Fp8Form(kept, block)`:

  * its first C - kept channels in float8_e4m3fn, one float32 scale per `block` of them (the
    last block may be shorter), beside it in "<name>_scale";
  * its trailing `kept` channels (an entry's rotary part) as they are, in "<name>_rope".

Entries ("csa.kv", "hca.kv") keep their rope_dim rotary channels and quantise the rest in
blocks of KV_SCALE_BLOCK = 64 channels, DeepSeek's reference recipe (the quantisation its
training simulates on the non-rotary part); the indexer's keys ("csa.index_k") are quantised
whole, one scale a row. A scale is the block's absmax / 448 (the largest e4m3 value) rounded
up to a power of two (DeepSeek's "ue8m0" scale format, as V3.2's fp8 index-K in
model/dsa_indexer.py): an fp8 value times it is exact in float32 and bfloat16, so
dequantising adds no rounding of its own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pdserve.kvcache.v4_layout import rope_of, scale_of
from pdserve.model.deepseek_v4.kv import SeqKV
from pdserve.model.dsa_indexer import FP8_DTYPE, quantize_fp8


class Fp8Form(NamedTuple):
    """How a paged component's row is stored in fp8 mode (the module's header)."""

    kept: int  # trailing channels kept in the model dtype ("<name>_rope"); 0: none
    block: int  # channels per scale of the quantised part


def quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, C] -> (float8_e4m3fn [N, C], float32 [N, ceil(C / block)]): a scale per block."""
    n, c = x.shape
    blocks = -(-c // block)
    padded = F.pad(x.float(), (0, blocks * block - c))  # zeros leave every absmax as it is
    q, scale = quantize_fp8(padded.view(n, blocks, block))  # [N, blocks, block], [N, blocks]
    return q.flatten(1)[:, :c], scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """(fp8 [N, C], float32 [N, blocks]) -> float32 [N, C]."""
    return q.float() * scale.repeat_interleave(block, dim=1)[:, : q.shape[1]]


def store_rows(seq: SeqKV, name: str, first: int, values: torch.Tensor, form: Fp8Form) -> None:
    """Entries first .. of component `name` <- values [N, C] (model dtype), quantised here if
    the pool stores `name` in fp8."""
    if seq.buffer_dtype(name) != FP8_DTYPE:
        seq.store_rows(name, first, values)
        return
    cut = values.shape[1] - form.kept
    q, scale = quantize(values[:, :cut], form.block)
    seq.store_rows(name, first, q)
    seq.store_rows(scale_of(name), first, scale)
    if form.kept:
        seq.store_rows(rope_of(name), first, values[:, cut:])


def rows(seq: SeqKV, name: str, count: int, form: Fp8Form, dtype: torch.dtype) -> torch.Tensor:
    """Entries 0 .. count - 1 of component `name` [count, C] in `dtype` (the model's),
    dequantised if the pool stores it in fp8."""
    stored = seq.rows(name, count)
    if stored.dtype != FP8_DTYPE:
        return stored
    x = dequantize(stored, seq.rows(scale_of(name), count), form.block).to(dtype)
    if form.kept:
        x = torch.cat((x, seq.rows(rope_of(name), count).to(dtype)), dim=1)
    return x
