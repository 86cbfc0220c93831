"""V4's RMS norms, as HF's DeepseekV4RMSNorm and DeepseekV4UnweightedRMSNorm compute them.

Unlike Llama's, the weighted norm keeps its weight in float32 (FLOAT32_PARAMS) and multiplies
it into the float32 normalised input before the cast back: weight * x_hat, then to x's dtype.
The unweighted one (the query heads, the hyper-connections' inputs) scales x in its own dtype
by a float32 rsqrt cast to that dtype.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D], x's dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:  # [..., D]
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
