"""V4's mixture of experts (HF's DeepseekV4SparseMoeBlock): a router, the routed experts and
one shared expert, every layer.

  * Scores: sqrt(softplus(logits)) (or sigmoid, `scoring_func`), in the model dtype: unlike
    V3, HF keeps V4's router weight in the model dtype; only the correction bias is float32.
  * Choice: `moe` layers take the top_k of score + e_score_correction_bias (float32);
    `hash_moe` layers take a fixed table, tid2eid[token id] (int64, HF's buffer; a parameter
    here so the loader fills it, never trained).
  * Weights: the chosen experts' unbiased scores, normalised to sum 1, times
    routed_scaling_factor (HF always normalises: config.py refuses norm_topk_prob false).
  * Experts: SwiGLU with clamped inputs (gate <= swiglu_limit, |up| <= swiglu_limit), stacked
    like V3's (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]); each token's outputs are
    added expert by expert in index order (model/moe.py's loop, with V4's clamp).
  * The shared expert: one clamped SwiGLU MLP of moe_intermediate_size (HF's DeepseekV4MLP,
    gate_proj / up_proj / down_proj by name), added after the routed sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.deepseek_v4.config import HASH_MOE, V4Arch


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class Router(nn.Module):
    def __init__(self, arch: V4Arch, hashed: bool) -> None:
        super().__init__()
        self.top_k, self.scoring = arch.top_k, arch.scoring_func
        self.routed_scaling_factor = arch.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(arch.num_experts, arch.hidden_size))
        self.tid2eid: nn.Parameter | None = None
        self.e_score_correction_bias: nn.Parameter | None = None
        if hashed:
            table = torch.zeros(arch.vocab_size, arch.top_k, dtype=torch.int64)
            self.tid2eid = nn.Parameter(table, requires_grad=False)
        else:
            bias = torch.zeros(arch.num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,  # [N, H]
        input_ids: torch.Tensor,  # [N]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [N, top_k] x.dtype, expert ids)
        logits = F.linear(x, self.weight)  # [N, E]
        scores = F.softplus(logits).sqrt() if self.scoring == "sqrtsoftplus" else logits.sigmoid()
        if self.tid2eid is not None:
            ids = self.tid2eid[input_ids].long()
        else:
            assert self.e_score_correction_bias is not None
            choice = scores + self.e_score_correction_bias
            ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class Experts(nn.Module):
    def __init__(self, arch: V4Arch) -> None:
        super().__init__()
        e, i, h = arch.num_experts, arch.moe_intermediate_size, arch.hidden_size
        self.limit = arch.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(e, h, i))  # [E, H, I]

    def forward(
        self,
        x: torch.Tensor,  # [N, H]
        ids: torch.Tensor,  # [N, top_k]
        weights: torch.Tensor,  # [N, top_k]
    ) -> torch.Tensor:  # [N, H]
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():  # one host read per layer
            token, slot = torch.where(ids == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.linear(clamped_swiglu(gate, up, self.limit), self.down_proj[e])
            out.index_add_(0, token, (h * weights[token, slot, None]).to(out.dtype))
        return out


class SharedExpert(nn.Module):
    def __init__(self, arch: V4Arch) -> None:
        super().__init__()
        h, i = arch.hidden_size, arch.moe_intermediate_size
        self.limit = arch.swiglu_limit
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class MoE(nn.Module):
    """Parameter names HF's: `mlp.gate.{weight,e_score_correction_bias,tid2eid}`,
    `mlp.experts.{gate_up_proj,down_proj}`, `mlp.shared_experts.{gate,up,down}_proj`."""

    def __init__(self, arch: V4Arch, layer_idx: int) -> None:
        super().__init__()
        self.gate = Router(arch, hashed=arch.mlp_layer_types[layer_idx] == HASH_MOE)
        self.experts = Experts(arch)
        self.shared_experts = SharedExpert(arch)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:  # [N, H]
        weights, ids = self.gate(x, input_ids)
        return self.experts(x, ids, weights) + self.shared_experts(x)
