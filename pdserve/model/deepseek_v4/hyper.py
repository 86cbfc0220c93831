"""Manifold-constrained hyper-connections (mHC): V4's residual is hc_mult streams per token.

Around each sublayer (attention, then the MLP) a `HyperConnection` (HF's
DeepseekV4HyperConnection, every op float32) reads the streams [T, hc, D], RMS-normed as one
flat [hc * D] vector, and maps them through `fn` to three sets of weights:
  * pre [hc]: collapses the streams into the sublayer's input, sum_j pre_j * stream_j;
  * post [hc]: spreads the sublayer's output over the streams (2 * sigmoid);
  * comb [hc, hc]: mixes the old streams into the new ones, projected towards a doubly
    stochastic matrix by Sinkhorn iterations (columns first, then rows and columns again);
    new stream k = post_k * output + sum_j comb[j, k] * stream_j (comb is read transposed).
`HyperHead` (DeepseekV4HyperHead) collapses the streams once more before the final norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.deepseek_v4.config import V4Arch
from pdserve.model.deepseek_v4.norm import unweighted_rms_norm


class HyperConnection(nn.Module):
    """Parameters HF's (`attn_hc.fn`, `.base`, `.scale`), all kept float32."""

    def __init__(self, arch: V4Arch) -> None:
        super().__init__()
        n, hidden = arch.hc_mult, arch.hidden_size
        self.hc, self.iters = n, arch.hc_sinkhorn_iters
        self.hc_eps, self.norm_eps = arch.hc_eps, arch.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(
        self,
        streams: torch.Tensor,  # [T, hc, D]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post [T, hc] float32, comb [T, hc, hc] float32, the sublayer's input [T, D])."""
        n, eps = self.hc, self.hc_eps
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())  # [T, (2 + hc) * hc]
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n)
        comb = torch.softmax(comb, dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def expand(
    post: torch.Tensor,  # [T, hc] float32
    comb: torch.Tensor,  # [T, hc, hc] float32
    out: torch.Tensor,  # [T, D]: the sublayer's output
    streams: torch.Tensor,  # [T, hc, D]: the streams the sublayer read
) -> torch.Tensor:  # [T, hc, D]
    """The new streams: the output spread by post, plus the old streams mixed by comb's
    transpose, in the streams' dtype (HF casts post and comb first)."""
    dtype = streams.dtype
    spread = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)
    return spread + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """Parameters HF's (`model.hc_head.hc_fn`, `.hc_base`, `.hc_scale`), kept float32."""

    def __init__(self, arch: V4Arch) -> None:
        super().__init__()
        n = arch.hc_mult
        self.hc_eps, self.norm_eps = arch.hc_eps, arch.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * arch.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:  # [T, hc, D] -> [T, D]
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())  # [T, hc]
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
