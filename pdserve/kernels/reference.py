"""The torch reference of every fused op: what runs on the CPU, with HF's numerics.

Each function computes exactly what the unfused model code did (the same ops in the same
order and dtypes), so CPU results, and float32 parity with HF transformers, do not change.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[N, D] -> [N, D]: HF's RMSNorm (normalised in float32, scaled in x's dtype)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): a pre-norm layer's residual stream and its input."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate then up) -> [N, I]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T]
    inv_freq: torch.Tensor,  # [D/2] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions (neox style: the two halves of each head)."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().unsqueeze(1).to(q.dtype), emb.sin().unsqueeze(1).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
