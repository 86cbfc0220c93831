"""Multi-head latent attention (DeepSeek-V2/V3): HF's expanded form, the absorbed form for a
step of decodes, and its rotary tables.

Per token the layer caches ONE vector (the KV layout's "latent" buffer, [1, kv_lora_rank +
qk_rope_head_dim]): the RMS-normed compressed KV, then the rotated key part that every head
shares. The expanded form re-expands the whole causal context from the cache each step:
`kv_b_proj` turns each cached latent into every head's non-rotary key and its value, the shared
rotated key is appended to each head's key, and softmax(q k^T * scale) v runs in the model's
dtype with float32 softmax, as HF's eager attention does. The backend only moves latents:
`store` writes this step's, `gather` returns each sequence's whole causal context from the pool
(attention/backend.py).

A step of decodes only, on a backend that can (a `LatentDecodeBackend`: the `triton` backend of
a latent pool, attention/mla_backend.py), runs the absorbed form instead (model/mla_absorbed.py):
`kv_b_proj`'s key half folded into the query, attention over the cached latents themselves, its
value half applied to the result; mathematically the same, and the decode no longer expands
every cached latent every step. Prompt chunks stay expanded (compute-bound there:
model/mla_absorbed.py says why), and so does every step on the `torch` backend (the CPU's), and
V3.2's decodes attend absorbed only to the indexer's picks (model/deepseek_v32.py `absorbed`).
A step of decodes and prompt chunks is split by the backend (`split`): its leading decode rows
attend absorbed, the rest expanded over the prompts' sequences alone (the expansion costs
context x heads x (nope + v) per sequence gathered, ~0.5 GB a layer for a 4K-token decode at
V3's dims), and the two outputs are joined in token order before one o_proj.

HF numerics: RoPE tables in float32 scaled by YaRN's attention factor; with `rope_interleave`
the (even, odd) pairs are rotated and written back as two halves, exactly as HF's
apply_rotary_pos_emb_interleave does, so the cached rotated keys are in HF's order.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

from pdserve.attention.backend import (
    AttentionContext,
    CausalContext,
    GatherBackend,
    LatentDecodeBackend,
)
from pdserve.kvcache.layout import LATENT
from pdserve.model.config import ModelArch
from pdserve.model.deepseek_config import MLAArch
from pdserve.model.llama import RMSNorm
from pdserve.model.mla_absorbed import absorb_query, expand_output, kv_b_halves
from pdserve.model.rope_scaling import RopeScaling, yarn_mscale

LATENT_NORM_EPS = 1e-6  # HF builds q_a_layernorm and kv_a_layernorm with the default eps


def rope_tables(dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2] float32, attention factor that scales cos and sin), as HF's
    default and YaRN rope initialisers compute them (same ops, same order)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if s.rope_type != "yarn":
        return 1.0 / pos_freqs, 1.0
    factor = s.factor
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = yarn_mscale(factor, s.mscale) / yarn_mscale(factor, s.mscale_all_dim)
    else:
        attention = yarn_mscale(factor)
    orig = s.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low: float = correction_dim(s.beta_fast)
    high: float = correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: divide it by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, attention


def rotate(
    x: torch.Tensor,  # [T, H, P]
    cos: torch.Tensor,  # [T, 1, P / 2]
    sin: torch.Tensor,  # [T, 1, P / 2]
    interleave: bool,
) -> torch.Tensor:  # [T, H, P]: rotated pairs, first members then second members
    """HF's rotary: pairs (x[2i], x[2i+1]) with `interleave`, else (x[i], x[i + P/2])."""
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class MLAttention(nn.Module):
    """HF's DeepseekV3Attention: parameter names match the checkpoint's."""

    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__()
        assert arch.mla is not None
        m: MLAArch = arch.mla
        self.layer_idx = layer_idx
        self.m = m
        self.num_heads = h = arch.num_heads
        hidden, bias = arch.hidden_size, m.attention_bias
        if m.q_lora_rank is None:
            self.q_proj: nn.Linear | None = nn.Linear(hidden, h * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, h * m.qk_head_dim, bias=False)
            self.q_proj = None
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(h * m.v_head_dim, hidden, bias=bias)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, P / 2]: the rope tables at each token's position
        sin: torch.Tensor,  # [T, 1, P / 2]
        ctx: AttentionContext[Any],
    ) -> torch.Tensor:  # [T, hidden]
        m, h, t = self.m, self.num_heads, x.shape[0]
        q_resid: torch.Tensor | None = None  # [T, q_lora_rank]: the query's latent
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        q = q.view(t, h, m.qk_head_dim)
        q_nope, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        kv_nope, k_rot = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        kv_nope = self.kv_a_layernorm(kv_nope)  # [T, R]
        q_rot = rotate(q_rot, cos, sin, m.rope_interleave)  # [T, H, P]
        k_rot = rotate(k_rot.view(t, 1, -1), cos, sin, m.rope_interleave)  # [T, 1, P]
        latent = torch.cat((kv_nope.view(t, 1, -1), k_rot), dim=-1)  # [T, 1, R + P]
        backend = cast(GatherBackend, ctx.backend)  # checked once per step: the model's forward
        backend.store(self.layer_idx, LATENT, latent, ctx.metadata)
        # A LatentDecodeBackend's verbs, looked up: isinstance of the protocol costs ~10 us a layer.
        absorbs = getattr(backend, "absorbs", None)
        if absorbs is None:
            out = self.expanded(x, q_resid, q_nope, q_rot, cos, sin, backend, ctx.metadata)
        elif absorbs(ctx.metadata):
            absorbing = cast(LatentDecodeBackend, backend)
            out = self.absorbed(x, q_resid, q_nope, q_rot, cos, sin, absorbing, ctx.metadata)
        else:
            absorbing = cast(LatentDecodeBackend, backend)
            out = self.mixed(x, q_resid, q_nope, q_rot, cos, sin, absorbing, ctx.metadata)
        return self.o_proj(out.reshape(t, h * m.v_head_dim))

    def mixed(
        self,
        x: torch.Tensor,  # [T, hidden]: the layer's normed input
        q_resid: torch.Tensor | None,  # [T, q_lora_rank]
        q_nope: torch.Tensor,  # [T, H, N]
        q_rot: torch.Tensor,  # [T, H, P]: rotated
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: LatentDecodeBackend,
        metadata: Any,
    ) -> torch.Tensor:  # [T, H, Dv]
        """A step with prompt chunks: its decodes (if the backend splits it off) absorbed,
        everything else expanded; the decodes lead the step, so rows :n are theirs."""
        parts = backend.split(metadata)
        if parts is None:
            return self.expanded(x, q_resid, q_nope, q_rot, cos, sin, backend, metadata)
        n = parts.decodes

        Rows = tuple[
            torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor,
            torch.Tensor,
        ]  # fmt: skip

        def rows(s: slice) -> Rows:  # the step's per-token inputs, rows `s`
            r = None if q_resid is None else q_resid[s]
            return x[s], r, q_nope[s], q_rot[s], cos[s], sin[s]

        decoded = self.absorbed(*rows(slice(None, n)), backend, parts.decode)
        prompted = self.expanded(*rows(slice(n, None)), backend, parts.rest)
        return torch.cat((decoded, prompted))

    def expanded(
        self,
        x: torch.Tensor,  # [T, hidden]: the layer's normed input
        q_resid: torch.Tensor | None,  # [T, q_lora_rank]
        q_nope: torch.Tensor,  # [T, H, N]
        q_rot: torch.Tensor,  # [T, H, P]: rotated
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: GatherBackend,
        metadata: Any,
    ) -> torch.Tensor:  # [T, H, Dv]
        """HF's eager attention over each sequence's whole causal context, every cached latent
        through kv_b_proj; this step's latents are already stored."""
        m, h, t = self.m, self.num_heads, x.shape[0]
        context = backend.gather(self.layer_idx, LATENT, metadata)
        seen = self.visible(x, q_resid, cos, sin, backend, metadata, context)  # [B, Q, L]
        cached = context.values[:, :, 0]  # [B, L, R + P]: each sequence's keys, padded
        b, length = cached.shape[:2]
        c_nope, c_rot = cached.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c_nope).view(b, length, h, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat((k_nope, c_rot[:, :, None, :].expand(b, length, h, -1)), dim=-1)
        query = context.pad(torch.cat((q_nope, q_rot), dim=-1))  # [B, Q, H, Dqk]
        # HF's eager attention: [B, H, Q, D] @ [B, H, D, L], masked, float32 softmax, @ v.
        scores = torch.matmul(query.transpose(1, 2), k.permute(0, 2, 3, 1)) * m.softmax_scale
        scores = scores.masked_fill(~seen[:, None], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(probs, v.transpose(1, 2)).transpose(1, 2)  # [B, Q, H, Dv]
        return context.unpad(out).reshape(t, h, m.v_head_dim)

    def absorbed(
        self,
        x: torch.Tensor,  # [T, hidden]: the layer's normed input
        q_resid: torch.Tensor | None,  # [T, q_lora_rank]
        q_nope: torch.Tensor,  # [T, H, N]
        q_rot: torch.Tensor,  # [T, H, P]: rotated
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: LatentDecodeBackend,
        metadata: Any,
    ) -> torch.Tensor:  # [T, H, Dv]
        """A step of decodes over the cached latents (model/mla_absorbed.py); this step's are
        already stored. V3.2 attends only to its indexer's picks (model/deepseek_v32.py)."""
        return self.attend_absorbed(q_nope, q_rot, backend, metadata)

    def attend_absorbed(
        self,
        q_nope: torch.Tensor,  # [T, H, N]
        q_rot: torch.Tensor,  # [T, H, P]: rotated
        backend: LatentDecodeBackend,
        metadata: Any,
        picked: tuple[torch.Tensor, torch.Tensor] | None = None,  # backend.index_topk's
    ) -> torch.Tensor:  # [T, H, Dv]
        m = self.m
        w_uk, w_uv = kv_b_halves(self.kv_b_proj.weight, self.num_heads, m)
        q_latent = absorb_query(q_nope, w_uk)  # [T, H, R]
        o_latent = backend.attend_latent(
            self.layer_idx, q_latent, q_rot, m.softmax_scale, metadata, picked
        )
        return expand_output(o_latent, w_uv)

    def visible(
        self,
        x: torch.Tensor,  # [T, hidden]
        q_resid: torch.Tensor | None,  # [T, q_lora_rank]
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: GatherBackend,
        metadata: Any,
        context: CausalContext,
    ) -> torch.Tensor:  # [B, Q, L] bool: the keys each new token attends to
        """Every causal key (dense attention). DeepSeek-V3.2 narrows it to its indexer's
        choice (model/deepseek_v32.py)."""
        return context.mask
