"""MLA's absorbed form (model/mla_absorbed.py): kv_b_proj's halves are views of its weight in
the order its output is split in (model/mla.py), and folding them into the query and the
output gives the expanded form's scores and outputs, in float64 to rounding."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.model.deepseek_config import MLAArch
from pdserve.model.mla_absorbed import absorb_query, expand_output, kv_b_halves

H, R, N, P, V, L, T = 3, 8, 6, 4, 5, 7, 2
ARCH = MLAArch(
    q_lora_rank=None,
    kv_lora_rank=R,
    qk_nope_head_dim=N,
    qk_rope_head_dim=P,
    v_head_dim=V,
    rope_interleave=True,
    softmax_scale=0.3,
    attention_bias=False,
)


def test_folding_kv_b_proj_gives_the_expanded_scores_and_outputs() -> None:
    gen = torch.Generator().manual_seed(0)
    kv_b = nn.Linear(R, H * (N + V), bias=False).double()
    kv_b.weight.data.copy_(torch.randn(kv_b.weight.shape, generator=gen))
    c = torch.randn(L, R, generator=gen, dtype=torch.float64)  # cached latents
    q_nope = torch.randn(T, H, N, generator=gen, dtype=torch.float64)
    probs = torch.randn(T, H, L, generator=gen, dtype=torch.float64).softmax(-1)

    w_uk, w_uv = kv_b_halves(kv_b.weight, H, ARCH)
    assert w_uk.shape == (H, N, R) and w_uv.shape == (H, V, R)
    assert w_uk.data_ptr() == kv_b.weight.data_ptr()  # views: nothing copied

    k_nope, v = kv_b(c).view(L, H, N + V).split([N, V], dim=-1)  # model/mla.py's expansion
    scores = torch.einsum("thn,lhn->thl", q_nope, k_nope)
    absorbed = torch.einsum("thr,lr->thl", absorb_query(q_nope, w_uk), c)
    torch.testing.assert_close(absorbed, scores, rtol=1e-12, atol=1e-12)

    out = torch.einsum("thl,lhv->thv", probs, v)
    o_latent = torch.einsum("thl,lr->thr", probs, c)
    torch.testing.assert_close(expand_output(o_latent, w_uv), out, rtol=1e-12, atol=1e-12)
