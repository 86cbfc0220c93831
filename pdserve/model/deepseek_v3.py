"""DeepSeek-V3 (HF's DeepseekV3ForCausalLM) read top to bottom: latent attention, then a dense
MLP in the first `first_k_dense_replace` layers and experts in the rest.

Pure: tokens arrive flat ([T]) with their positions, attention through one AttentionContext
whose backend must offer the generic store/gather pair (attention/backend.py GatherBackend:
the `torch` backend, or the `triton` one of a latent pool, on which a step of decodes runs in
MLA's absorbed form: model/mla.py). Parameter names are HF's, except that gate
and up are fused (`gate_up_proj`, in the dense MLP, the shared experts and the stacked routed
experts): model/weight_map.py maps checkpoints onto them. Numerics follow HF (float32 RoPE
tables and router, RMSNorm in float32), so greedy outputs match transformers in float32.
Multi-token prediction layers are not part of this model (the loader skips their weights).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdserve.attention.backend import AttentionContext, GatherBackend
from pdserve.kernels import ops
from pdserve.model.config import ModelArch
from pdserve.model.llama import RMSNorm
from pdserve.model.mla import MLAttention, rope_tables
from pdserve.model.moe import FLOAT32_PARAMS, GatedMLP, MoE
from pdserve.parallel.dp_tokens import DpTokens
from pdserve.parallel.group import RankGroup


class DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        layer_idx: int,
        attention: type[MLAttention] = MLAttention,
        group: RankGroup | None = None,
    ) -> None:
        super().__init__()
        assert arch.moe is not None
        self.self_attn = attention(arch, layer_idx)
        self.mlp: nn.Module = (
            MoE(arch.moe, arch.hidden_size, group)
            if arch.moe.is_moe(layer_idx)
            else GatedMLP(arch.hidden_size, arch.intermediate_size)
        )
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the last sublayer's output (the embedding at first)
        residual: torch.Tensor | None,  # the residual stream before it (None at first)
        cos: torch.Tensor,  # [T, 1, rope_dim / 2]
        sin: torch.Tensor,
        ctx: AttentionContext[Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's `x = x + attn(norm(x)); x = x + mlp(norm(x))`, each add fused into the norm
        after it (as in model/llama.py): returns (mlp output, residual stream before it)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h = self.self_attn(h, cos, sin, ctx)
        h, residual = self.post_attention_layernorm.add(h, residual)
        return self.mlp(h), residual


class Backbone(nn.Module):
    def __init__(
        self, arch: ModelArch, attention: type[MLAttention], group: RankGroup | None = None
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, i, attention, group) for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    """Parameter names match HF checkpoints (model.*, lm_head.weight)."""

    FLOAT32_PARAMS: tuple[str, ...] = FLOAT32_PARAMS  # the loader keeps these float32
    # Dequantised whatever --quantization says: absorbed decode reads kv_b_proj's halves.
    DEQUANTISED_PARAMS: tuple[str, ...] = ("self_attn.kv_b_proj.weight",)
    ATTENTION: type[MLAttention] = MLAttention  # each layer's (V3.2: with its indexer)

    def __init__(self, arch: ModelArch, group: RankGroup | None = None) -> None:
        """`group`: expert-parallel ranks (model/moe.py); the rest of the model is whole on
        each (ModelArch.for_rank)."""
        super().__init__()
        if arch.mla is None or arch.moe is None:
            raise ValueError(f"{arch.architecture} is not a DeepSeek-V3 architecture")
        self.arch = arch
        self.model = Backbone(arch, self.ATTENTION, group)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", torch.empty(arch.mla.qk_rope_head_dim // 2), False)
        self.rope_factor = 1.0
        self.derive_buffers(self.inv_freq.device)  # on the meta device, the loader redoes it

    def derive_buffers(self, device: torch.device) -> None:
        """The RoPE table (never in a checkpoint), float32 like HF's, on `device`."""
        assert self.arch.mla is not None
        inv_freq, factor = rope_tables(
            self.arch.mla.qk_rope_head_dim, self.arch.rope_theta, self.arch.rope_scaling
        )
        self.inv_freq = inv_freq.to(device)
        self.rope_factor = factor

    def tie_weights(self) -> None:
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        ctx: AttentionContext[Any],
    ) -> torch.Tensor:  # [T, hidden]
        if not isinstance(ctx.backend, GatherBackend):
            raise ValueError(
                f"attention backend {ctx.backend.name!r} cannot serve latent attention "
                "(it has no store/gather); use the 'torch' backend"
            )
        x = self.model.embed_tokens(input_ids)
        # HF: cos/sin of cat(freqs, freqs) times the attention factor, in x's dtype; each
        # rotation reads the first half.
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, P / 2]
        cos = (freqs.cos() * self.rope_factor).to(x.dtype)[:, None, :]  # [T, 1, P / 2]
        sin = (freqs.sin() * self.rope_factor).to(x.dtype)[:, None, :]
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        if residual is None:  # a model with no layers
            return self.model.norm(x)
        return self.model.norm.add(x, residual)[0]

    def data_parallel(self, dp: DpTokens) -> None:
        """Data-parallel attention (`--dp`): this rank attends only its own requests, and each
        MoE layer exchanges tokens with the other ranks through `dp` (parallel/dp_tokens.py)."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.dp = dp

    def idle(self) -> torch.Tensor:  # [0, hidden]
        """A data-parallel rank with no tokens this step: it joins every MoE layer's exchange
        with none of its own, as a forward would, and computes nothing else."""
        weight = self.model.embed_tokens.weight
        x = weight.new_empty(0, self.arch.hidden_size)
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab], model dtype
        """The sampler widens to float32 only the rows that need more than an argmax."""
        return self.lm_head(hidden)

    def graph_safe(self) -> bool:
        """Whether a decode step may be captured in a CUDA graph (engine/cuda_graphs.py): when
        the routed experts run fused (model/moe.py's torch loop asks the host which experts
        were chosen). V3.2 inherits it (its decode-step indexer is graph-safe); V4, a model of
        its own, has none, so it stays eager."""
        return ops.fused_moe_applies(self.lm_head.weight)
