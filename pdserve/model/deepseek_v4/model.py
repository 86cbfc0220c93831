"""DeepSeek-V4 (HF's DeepseekV4ForCausalLM) read top to bottom.

Tokens arrive flat ([T]) with their positions; the step's sequences and their KV arrive as a
`StepKV` (kv.py), from the attention backend (`ctx.backend.step_kv(ctx.metadata)`, a
`V4KVBackend`) or, in tests, directly (`forward_kv`). Each token's embedding becomes hc_mult
identical residual streams; every layer wraps its attention (attention.py) and its MoE
(moe.py) in hyper-connections (hyper.py); the head's hyper-connection collapses the streams
before the final norm. Multi-token prediction layers are not part of this model (the loader
skips their weights).

Pure and batched over the step's tokens, except attention's per-sequence part. Parameter
names are HF's; `FLOAT32_PARAMS` are those HF keeps float32 in a bf16 model
(`_keep_in_fp32_modules_strict`), which the loader allocates float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pdserve.attention.backend import AttentionContext
from pdserve.model.config import ModelArch
from pdserve.model.deepseek_v4.attention import V4Attention
from pdserve.model.deepseek_v4.config import V4Arch
from pdserve.model.deepseek_v4.hyper import HyperConnection, HyperHead, expand
from pdserve.model.deepseek_v4.kv import Span, StepKV, V4KVBackend
from pdserve.model.deepseek_v4.moe import MoE
from pdserve.model.deepseek_v4.norm import RMSNorm
from pdserve.model.deepseek_v4.rope import RopeTable, StepRope

FLOAT32_PARAMS: tuple[str, ...] = (
    "attn_hc.fn", "attn_hc.base", "attn_hc.scale",
    "ffn_hc.fn", "ffn_hc.base", "ffn_hc.scale",
    "hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale",
    "self_attn.sinks", "position_bias", "mlp.gate.e_score_correction_bias",
    "q_a_norm.weight", "kv_norm.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight",
)  # fmt: skip


class DecoderLayer(nn.Module):
    def __init__(self, arch: V4Arch, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = V4Attention(arch, layer_idx)
        self.mlp = MoE(arch, layer_idx)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.attn_hc = HyperConnection(arch)
        self.ffn_hc = HyperConnection(arch)

    def forward(
        self,
        streams: torch.Tensor,  # [T, hc, hidden]
        input_ids: torch.Tensor,  # [T]: hash_moe layers route by token id
        rope: StepRope,
        kv: StepKV,
    ) -> torch.Tensor:  # [T, hc, hidden]
        post, comb, h = self.attn_hc(streams)
        streams = expand(post, comb, self.self_attn(self.input_layernorm(h), rope, kv), streams)
        post, comb, h = self.ffn_hc(streams)
        return expand(post, comb, self.mlp(self.post_attention_layernorm(h), input_ids), streams)


class Backbone(nn.Module):
    def __init__(self, arch: V4Arch) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.hc_head = HyperHead(arch)


def check_spans(spans: Sequence[Span], tokens: int) -> None:
    """The spans tile the step's T tokens in order, none empty."""
    at = 0
    for b, s in enumerate(spans):
        if s.first != at or s.length < 1 or s.start < 0:
            raise ValueError(f"span {b} {s} does not continue the step's tokens at row {at}")
        at += s.length
    if at != tokens:
        raise ValueError(f"the spans cover {at} tokens, the step has {tokens}")


class DeepseekV4ForCausalLM(nn.Module):
    """Parameter names match HF checkpoints (model.*, lm_head.weight)."""

    FLOAT32_PARAMS = FLOAT32_PARAMS

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        if arch.v4 is None:
            raise ValueError(f"{arch.architecture} is not a DeepSeek-V4 architecture")
        self.arch, self.v4 = arch, arch.v4
        self.model = Backbone(arch.v4)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.main_inv_freq: torch.Tensor
        self.compress_inv_freq: torch.Tensor
        self.register_buffer("main_inv_freq", torch.empty(arch.v4.main_rope.dim // 2), False)
        self.register_buffer(
            "compress_inv_freq", torch.empty(arch.v4.compress_rope.dim // 2), False
        )
        self.main_factor = self.compress_factor = 1.0
        self.derive_buffers(self.main_inv_freq.device)  # on the meta device, the loader redoes it

    def derive_buffers(self, device: torch.device) -> None:
        """The two RoPE tables (never in a checkpoint), float32 like HF's, on `device`."""
        self.main_inv_freq, self.main_factor = RopeTable.build(self.v4.main_rope, device)
        self.compress_inv_freq, self.compress_factor = RopeTable.build(
            self.v4.compress_rope, device
        )

    def tie_weights(self) -> None:
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        ctx: AttentionContext[Any],
    ) -> torch.Tensor:  # [T, hidden]
        if not isinstance(ctx.backend, V4KVBackend):
            raise ValueError(
                f"attention backend {ctx.backend.name!r} cannot serve DeepSeek-V4 (it has no "
                "step_kv); use the 'torch' backend"
            )
        return self.forward_kv(input_ids, positions, ctx.backend.step_kv(ctx.metadata))

    def forward_kv(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]: span b's tokens at start_b, start_b + 1, ...
        kv: StepKV,
    ) -> torch.Tensor:  # [T, hidden]
        check_spans(kv.spans, input_ids.shape[0])
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        main = RopeTable(self.main_inv_freq, self.main_factor)
        compress = RopeTable(self.compress_inv_freq, self.compress_factor)
        rope = StepRope(main.at(positions, x.dtype), compress.at(positions, x.dtype), compress)
        streams = x[:, None, :].expand(-1, self.v4.hc_mult, -1).contiguous()  # [T, hc, hidden]
        for layer in self.model.layers:
            streams = layer(streams, input_ids, rope, kv)
        return self.model.norm(self.model.hc_head(streams))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab], model dtype
        """The sampler widens to float32 only the rows that need more than an argmax."""
        return self.lm_head(hidden)
