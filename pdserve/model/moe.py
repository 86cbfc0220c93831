"""DeepSeek-V3's mixture of experts: the sigmoid router, the routed experts, the shared ones.

HF numerics (DeepseekV3TopkRouter, DeepseekV3Experts, DeepseekV3MoE), so greedy outputs match
transformers in float32:
  * the router scores in float32 (its weight and correction bias stay float32 whatever the
    model's dtype: `FLOAT32_PARAMS`, honoured by the loader); sigmoid, plus the bias for the
    choice only; groups ranked by the sum of their two best biased scores, the best
    `topk_group` kept; the top_k experts among them; weights are the UNbiased scores,
    normalised to sum 1 (norm_topk_prob), times routed_scaling_factor;
  * experts are stacked tensors: `gate_up_proj` [E, 2I, H] (gate rows then up rows) and
    `down_proj` [E, H, I] (HF 5's in-memory layout; checkpoints with per-expert tensors are
    stacked at load time, model/weight_map.py); each routed expert's output, times its weight,
    is added into the token's sum expert by expert in index order, as HF does;
  * the shared experts are one gated MLP whose width is n_shared_experts experts.

On CUDA the routed experts run fused (kernels/triton_moe.py, chosen by kernels/ops.py): the
assignments sorted by expert on the device and two grouped GEMMs, with the loop's roundings
and summation order, and no host read, so the layer can be captured in a CUDA graph. The
router is torch ops on the device throughout (no host read either). `Experts.loop` is the
torch path: the CPU's, and the oracle the fused one is tested against.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels import fp8_blocks, ops
from pdserve.model.deepseek_config import MoEArch
from pdserve.parallel.dp_tokens import DpTokens
from pdserve.parallel.group import RankGroup
from pdserve.parallel.layers import Run, Shard, Sharded

# Parameter names (suffixes) kept in float32 whatever the model's dtype, as HF keeps them.
FLOAT32_PARAMS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one `gate_up_proj` [2I, H]."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class TopkRouter(nn.Module):
    def __init__(self, moe: MoEArch, hidden: int) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden, dtype=torch.float32))
        # A buffer in HF, a parameter here so the loader fills it like any checkpoint tensor.
        bias = torch.zeros(moe.num_experts, dtype=torch.float32)
        self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, top_k] float32, expert ids [N, top_k])."""
        m = self.moe
        logits = nn.functional.linear(x.float(), self.weight.float())  # [N, E]
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias  # [N, E]
        per_group = m.num_experts // m.n_group
        grouped = choice.view(-1, m.n_group, per_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [N, n_group]
        groups = torch.topk(group_scores, k=m.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1)  # [N, n_group]
        keep_experts = (
            keep.unsqueeze(-1).expand(-1, m.n_group, per_group).reshape(-1, m.num_experts)
        )
        choice = choice.masked_fill(~keep_experts.bool(), float("-inf"))
        ids = torch.topk(choice, k=m.top_k, dim=-1, sorted=False)[1]  # [N, top_k]
        weights = scores.gather(1, ids)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * m.routed_scaling_factor, ids


class Experts(Sharded):
    """The routed experts, stacked (HF's DeepseekV3Experts parameter names). When the loader
    keeps them fp8 (model/fp8_weights.py: both or neither), both are float8_e4m3fn with float32
    block scales beside them (`P_scale_inv` [E, rows / 128, cols / 128]) and multiply as
    kernels/fp8_blocks.py says; `fp8_pow2_scales` (set by the loader for ue8m0 checkpoints)
    rounds the activations' group scales up to powers of two, fused or looped.

    Expert parallel (`group` of N ranks): this rank holds experts [first, first + E / N) of the
    whole stack (their shards, parallel/layers.py) and adds only their outputs; MoE sums the
    ranks' partial outputs (one all-reduce)."""

    FP8_PARAMS = ("gate_up_proj", "down_proj")  # what the loader may keep fp8

    def __init__(self, moe: MoEArch, hidden: int, group: RankGroup | None = None) -> None:
        group = group or RankGroup.single()
        super().__init__(group)
        e, i = moe.num_experts, moe.moe_intermediate_size
        self.count = e // group.world_size  # (ModelArch.for_rank checked that it divides)
        self.first = group.rank * self.count
        if group.world_size > 1:
            for name, rest in (("gate_up_proj", (2 * i, hidden)), ("down_proj", (hidden, i))):
                self.shards[name] = Shard(0, (e, *rest), (Run(self.first, 0, self.count),))
        self.gate_up_proj = nn.Parameter(torch.empty(self.count, 2 * i, hidden))  # [E/N, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(self.count, hidden, i))  # [E/N, H, I]
        self.gate_up_proj_scale_inv: nn.Parameter | None  # fp8 only
        self.down_proj_scale_inv: nn.Parameter | None
        self.register_parameter("gate_up_proj_scale_inv", None)
        self.register_parameter("down_proj_scale_inv", None)
        self.fp8_pow2_scales: bool = False

    def forward(
        self,
        x: torch.Tensor,  # [N, H]
        ids: torch.Tensor,  # [N, top_k]
        weights: torch.Tensor,  # [N, top_k] float32
    ) -> torch.Tensor:  # [N, H]: the output of this rank's experts
        fused = ops.fused_moe_applies(x)
        if self.shards:  # expert parallel: ids as this rank's, the others' skipped
            ids = ids - self.first
            mine = (ids >= 0) & (ids < self.count)
            # fused: an id past the experts is nobody's (kernels/moe_align.py); the loop: -1
            ids = torch.where(mine, ids, self.count if fused else -1)
        if fused:  # CUDA: grouped GEMMs, no host sync (kernels/triton_moe.py)
            return ops.fused_moe(
                x, ids, weights, self.gate_up_proj, self.down_proj,
                self.gate_up_proj_scale_inv, self.down_proj_scale_inv, self.fp8_pow2_scales,
            )  # fmt: skip
        return self.loop(x, ids, weights)

    def loop(
        self,
        x: torch.Tensor,  # [N, H]
        ids: torch.Tensor,  # [N, top_k]
        weights: torch.Tensor,  # [N, top_k] float32
    ) -> torch.Tensor:  # [N, H]
        """HF's loop over the chosen experts: the CPU's path, and what the fused one equals.
        fp8 experts: x is quantised once per token (its groups are the same for every expert),
        each expert's products are block-scaled, h is quantised before the down product."""
        out = torch.zeros_like(x)
        up_scale, down_scale = self.gate_up_proj_scale_inv, self.down_proj_scale_inv
        pow2 = self.fp8_pow2_scales
        xq, xs = fp8_blocks.act_quant(x, pow2=pow2) if up_scale is not None else (x, x)
        # One host read per layer: which experts any token chose, in index order.
        for e in torch.unique(ids).tolist():
            if e < 0:  # expert parallel: another rank's
                continue
            token, slot = torch.where(ids == e)  # the tokens routed to e, and at which rank
            if up_scale is None or down_scale is None:
                h = ops.silu_mul(nn.functional.linear(x[token], self.gate_up_proj[e]))  # [n, I]
                h = nn.functional.linear(h, self.down_proj[e])  # [n, H]
            else:
                g = fp8_blocks.block_linear(
                    xq[token], xs[token], self.gate_up_proj[e], up_scale[e], x.dtype
                )  # [n, 2I]
                h = fp8_blocks.linear(ops.silu_mul(g), self.down_proj[e], down_scale[e], pow2)
            out.index_add_(0, token, (h * weights[token, slot, None]).to(out.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, moe: MoEArch, hidden: int, group: RankGroup | None = None) -> None:
        """`group`: the expert-parallel ranks the routed experts are split over (Experts).
        With data-parallel attention (`dp`, set by the model's `data_parallel`) each rank
        brings only its own tokens: they are gathered before the gate and each rank keeps its
        own rows of the sum (parallel/dp_tokens.py); else every rank has every token."""
        super().__init__()
        self.group = group or RankGroup.single()
        self.dp: DpTokens | None = None
        self.gate = TopkRouter(moe, hidden)
        self.experts = Experts(moe, hidden, self.group)
        width = moe.moe_intermediate_size * moe.n_shared_experts
        self.shared_experts = GatedMLP(hidden, width) if width else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        every = x if self.dp is None else self.dp.gather(x)  # [sum over ranks, H]
        weights, ids = self.gate(every)  # every rank routes every token alike
        part = self.experts(every, ids, weights).contiguous()  # this rank's experts' share
        out = self.group.all_reduce_sum(part) if self.dp is None else self.dp.own_sum(part)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
