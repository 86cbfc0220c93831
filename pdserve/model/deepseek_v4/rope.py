"""V4's rotary embedding: two tables, the trailing slice of each head, (even, odd) pairs.

Sliding-window-only layers rotate by the "main" table; CSA and HCA layers, their compressed
entries (at the position of their window's first token) and the indexer's queries and keys by
the "compress" table (its own theta, YaRN possibly). Only the last `dim` channels of a head
rotate, pair (2i, 2i + 1) by angle position * inv_freq[i], and the result stays interleaved.
Because V4's keys are its values, attention's output carries the keys' rotation: the layer
rotates it back by its query's angle (`sign=-1`) before the output projection.

HF numerics: frequencies in float32 (model/mla.py's `rope_tables`, HF's default and YaRN
initialisers), cos and sin times the attention factor then cast to the model dtype, and the
rotation itself in float32 on the model-dtype cos/sin, cast back.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdserve.model.deepseek_v4.config import RopeSpec
from pdserve.model.mla import rope_tables


class RopeTable(NamedTuple):
    inv_freq: torch.Tensor  # [dim / 2] float32
    factor: float  # scales cos and sin (YaRN's attention factor; 1.0 otherwise)

    @classmethod
    def build(cls, spec: RopeSpec, device: torch.device) -> RopeTable:
        inv_freq, factor = rope_tables(spec.dim, spec.theta, spec.scaling)
        return cls(inv_freq.to(device), factor)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> Angles:
        """cos and sin [N, dim / 2] at `positions` [N], in `dtype`."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return Angles((freqs.cos() * self.factor).to(dtype), (freqs.sin() * self.factor).to(dtype))


class Angles(NamedTuple):
    cos: torch.Tensor  # [N, dim / 2]
    sin: torch.Tensor

    def rotate(self, x: torch.Tensor, sign: int = 1) -> torch.Tensor:
        """x [N, D] or [N, H, D] with its last `dim` channels rotated by +-angle (`sign`)."""
        cos, sin = self.cos, self.sin if sign > 0 else -self.sin
        if x.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        width = cos.shape[-1]
        kept, rot = x[..., :-width], x[..., -width:]
        # (a, b) -> (-b, a) per pair: with cos and sin, pair i turns by its angle.
        turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
        rotated = (rot.float() * cos + turned.float() * sin).to(x.dtype)
        return torch.cat((kept, rotated), dim=-1)

    def rows(self, index: slice) -> Angles:
        return Angles(self.cos[index], self.sin[index])


class StepRope(NamedTuple):
    """A step's angles at its tokens' positions, for each table, and the compress table
    itself (compressed entries sit at positions of their own)."""

    main: Angles  # [T, main dim / 2]
    compress: Angles  # [T, compress dim / 2]
    compress_table: RopeTable
