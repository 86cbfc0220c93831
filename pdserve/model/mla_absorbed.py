"""Multi-head latent attention's absorbed form, for decode: `kv_b_proj` folded into the query
and the output, so that attention runs over the cached latents themselves.

`kv_b_proj` ([H * (N + V), R]) is, per head h, W_UK[h] [N, R] (the non-rotary key's half) then
W_UV[h] [V, R] (the value's); a cached latent c [R] becomes head h's key W_UK[h] c and value
W_UV[h] c. Both are linear in c, so for a query q_nope[h] [N] and softmax weights p over the
keys:

    q_nope[h] . (W_UK[h] c)  == q_latent[h] . c,     q_latent[h] = q_nope[h] W_UK[h]   [R]
    sum_l p_l (W_UV[h] c_l)  == W_UV[h] o_latent[h],  o_latent[h] = sum_l p_l c_l       [R]

The rotated part is unchanged (q_rope[h] . k_rope, k_rope shared by all heads), and so is the
softmax scale (YaRN's mscale included: MLAArch.softmax_scale). Attention is then multi-query
over rows [c | k_rope] of R + P values (576 for V3), read once a step for all heads, where the
expanded form multiplies every cached latent by kv_b_proj every step: per decode token and
layer, L * R * H * (N + V) multiply-adds (L context tokens) become R * H * (N + V) once.

Prefill keeps the expanded form: with as many queries as keys it is compute-bound, and absorbed
every query-key pair would cost R + P + R multiply-adds per head instead of N + P + V (1,088
vs 320 for V3), more than the expansion saves. W_UK and W_UV are views of kv_b_proj's weight
(nothing is copied, nothing to keep in step with the loader); the two products are batched
matmuls over heads in the model's dtype, as kv_b_proj itself is.
"""

from __future__ import annotations

import torch

from pdserve.model.deepseek_config import MLAArch


def kv_b_halves(
    weight: torch.Tensor,  # [H * (N + V), R]: kv_b_proj.weight
    num_heads: int,
    m: MLAArch,
) -> tuple[torch.Tensor, torch.Tensor]:  # (W_UK [H, N, R], W_UV [H, V, R]), views
    """kv_b_proj's key and value halves per head."""
    per_head = weight.view(num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    w_uk, w_uv = per_head.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
    return w_uk, w_uv


def absorb_query(
    q_nope: torch.Tensor,  # [T, H, N]
    w_uk: torch.Tensor,  # [H, N, R]
) -> torch.Tensor:  # [T, H, R]: q_latent[t, h] = q_nope[t, h] W_UK[h]
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def expand_output(
    o_latent: torch.Tensor,  # [T, H, R]: each head's softmax-weighted sum of latents
    w_uv: torch.Tensor,  # [H, V, R]
) -> torch.Tensor:  # [T, H, V]: out[t, h] = W_UV[h] o_latent[t, h]
    return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
