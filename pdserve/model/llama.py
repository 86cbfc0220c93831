"""The Llama family (Llama, Mistral, Qwen2, Qwen3) as one model, read top to bottom.

Pure: no scheduling, sockets or parallelism. Tokens arrive flat ([T]) with their positions;
attention arrives as one AttentionContext (a backend and this step's metadata): each layer
computes q, k and v, then asks the backend to rotate q and k (RoPE) and store the new K/V,
and to attend. Where K/V live (the paged pool) and which kernel runs are the backend's
business. Numerics follow the HF reference (float32 RoPE, RMSNorm in float32) so greedy
outputs match HF transformers token for token.

Fused for fewer kernel launches (docs/architecture.md §Layers, `model/`): q, k and v come from one
`qkv_proj`, gate and up from one `gate_up_proj` (the loader concatenates the checkpoint's
tensors: model/weight_map.py), and RMSNorm with the residual add, SiLU-and-multiply and RoPE
are single ops (kernels/ops.py: Triton on CUDA, the unfused torch reference elsewhere), as is
the down projection of SiLU-and-multiply at batch 1 (`Linear`: a decode row's weight products
run kernels/ops.linear's skinny matmul there, cuBLAS otherwise). The
residual stream travels beside the hidden state, vLLM-style: each layer returns both, and
the next norm adds them.

Tensor parallelism (`group`, a RankGroup of N ranks: parallel/): each rank holds num_heads / N
query heads and the KV heads they read (ModelArch.for_rank: `self.arch` is that rank's view, so
its attention backend and KV pool see its heads only), the matching slices of qkv_proj and
gate_up_proj (column-parallel, split per q/k/v and gate/up part), o_proj and down_proj
(row-parallel: a partial sum, all-reduced), and its rows of the vocab (the embedding and the
LM head, whose logits are gathered whole on every rank). At N = 1 every layer is the plain
module below, and the model is exactly the single-device one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pdserve.attention.backend import AttentionContext, Rope
from pdserve.kernels import ops
from pdserve.model.config import ModelArch, RopeScaling
from pdserve.parallel.group import RankGroup
from pdserve.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    Part,
    RowParallelLinear,
    VocabParallelEmbedding,
)


class Linear(nn.Linear):
    """nn.Linear (HF's parameter names) whose products go through kernels/ops.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


def column(
    in_features: int, parts: tuple[Part, ...], bias: bool, group: RankGroup
) -> Linear | ColumnParallelLinear:
    """`parts` fused along the output: a Linear at TP 1, else this rank's slice of each part
    (a part of fewer heads than ranks, KV's, replicated)."""
    if group.world_size == 1:
        return Linear(in_features, sum(p.size for p in parts), bias=bias)
    return ColumnParallelLinear(in_features, parts, bias, group, ops.linear, replicate=True)


def row(
    in_features: int, out_features: int, bias: bool, group: RankGroup, units: int
) -> Linear | RowParallelLinear:
    """A Linear at TP 1, else this rank's `units` / N input blocks, all-reduced after."""
    if group.world_size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, group, units, ops.linear)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, D]
        return ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept; the band between is blended.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv_freq


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, group: RankGroup) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # which of the backend's per-layer KV caches is ours
        mine = arch.for_rank(group.world_size, group.rank)  # this rank's heads (TP 1: all)
        self.num_heads = mine.num_heads
        self.num_kv_heads = mine.num_kv_heads
        self.head_dim = d = arch.head_dim
        q_out, kv_out = mine.num_heads * d, mine.num_kv_heads * d
        self.qkv_split = (q_out, kv_out, kv_out)
        h, hq, hkv = arch.hidden_size, arch.num_heads, arch.num_kv_heads
        qkv = (Part(hq * d, hq), Part(hkv * d, hkv), Part(hkv * d, hkv))
        self.qkv_proj = column(h, qkv, arch.qkv_bias, group)
        self.o_proj = row(hq * d, h, arch.o_bias, group, units=hq)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: Rope,  # the step's positions and inv_freq, shared by every layer
        ctx: AttentionContext[Any],
    ) -> torch.Tensor:  # [T, hidden]
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # views of the fused output
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # per head (Qwen3)
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(t, self.num_kv_heads, self.head_dim)
        q, k = ctx.backend.rope_store_kv(self.layer_idx, q, k, v, rope, ctx.metadata)
        o = ctx.backend.attend(self.layer_idx, q, k, v, ctx.metadata)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, group: RankGroup) -> None:
        super().__init__()
        h, i, bias = arch.hidden_size, arch.intermediate_size, arch.mlp_bias
        # gate rows, then up rows (at TP N: this rank's gate rows, then its up rows)
        self.gate_up_proj = column(h, (Part(i, i), Part(i, i)), bias, group)
        self.down_proj = row(i, h, bias, group, units=i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        gate_up = self.gate_up_proj(x)  # [T, 2 * I / N]
        down = self.down_proj
        if isinstance(down, RowParallelLinear):  # this rank's partial sum, all-reduced
            return down(gate_up, ops.silu_mul_linear)
        return ops.silu_mul_linear(gate_up, down.weight, down.bias)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, group: RankGroup) -> None:
        super().__init__()
        self.self_attn = Attention(arch, layer_idx, group)
        self.mlp = MLP(arch, group)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the last sublayer's output (the embedding at first)
        residual: torch.Tensor | None,  # the residual stream before it (None at first)
        rope: Rope,
        ctx: AttentionContext[Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's `x = x + attn(norm(x)); x = x + mlp(norm(x))`, with each add fused into the
        norm after it: returns (mlp output, residual stream before it)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h = self.self_attn(h, rope, ctx)
        h, residual = self.post_attention_layernorm.add(h, residual)
        return self.mlp(h), residual


class Backbone(nn.Module):
    def __init__(self, arch: ModelArch, group: RankGroup) -> None:
        super().__init__()
        v, h = arch.vocab_size, arch.hidden_size
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding = (
            nn.Embedding(v, h) if group.world_size == 1 else VocabParallelEmbedding(v, h, group)
        )
        self.layers = nn.ModuleList(DecoderLayer(arch, i, group) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class CausalLM(nn.Module):
    """Parameter names match HF checkpoints (model.*, lm_head.weight). `group`: the tensor-
    parallel ranks this one is among (default: TP 1); `arch` is then this rank's view."""

    def __init__(self, arch: ModelArch, group: RankGroup | None = None) -> None:
        super().__init__()
        group = group or RankGroup.single()
        self.group = group
        self.arch = arch.for_rank(group.world_size, group.rank)
        self.model = Backbone(arch, group)
        v, h = arch.vocab_size, arch.hidden_size
        self.lm_head: nn.Linear | ParallelLMHead = (
            nn.Linear(h, v, bias=False) if group.world_size == 1 else ParallelLMHead(h, v, group)
        )
        inv_freq = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def tie_weights(self) -> None:
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        ctx: AttentionContext[Any],
    ) -> torch.Tensor:  # [T, hidden]
        x = self.model.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        rope = Rope(positions, self.inv_freq)
        for layer in self.model.layers:
            x, residual = layer(x, residual, rope, ctx)
        if residual is None:  # a model with no layers
            return self.model.norm(x)
        return self.model.norm.add(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab], model dtype
        """The sampler widens to float32 only the rows that need more than an argmax."""
        return self.lm_head(hidden)

    def graph_safe(self) -> bool:
        """A decode step may be captured in a CUDA graph (engine/cuda_graphs.py)."""
        return True
