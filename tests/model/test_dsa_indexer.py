"""The V3.2 lightning indexer against HF transformers' own DeepseekV32Indexer, and its fp8 mode
against a plain float32 reference.

HF's indexer is instantiated from a tiny config (16 heads: with 4, exact 0.0 ties at the top-k
cut made HF's choice depend on torch.topk internals), our module takes its weights by name,
and both see the same inputs. HF's float32 scores are captured at its `topk` call.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pdserve.kvcache.layout import BufferSpec, KVLayout
from pdserve.model.dsa_indexer import (
    FP8_DTYPE,
    FP8_MAX,
    Indexer,
    IndexerArch,
    IndexKMode,
    dequantize_index_k,
    hadamard_rotate,
    index_k_buffers,
    index_k_for_cache,
    quantize_fp8,
    quantize_index_k,
    select,
)

hf_v32 = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
from transformers import DeepseekV32Config  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

HIDDEN, Q_LORA, HEADS, HEAD_DIM, ROPE, TOPK = 64, 48, 16, 32, 16, 12
PROMPT, DECODES = 40, 4


def _config() -> DeepseekV32Config:
    return DeepseekV32Config(
        vocab_size=128,
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=Q_LORA,
        kv_lora_rank=32,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_n_heads=HEADS,
        index_head_dim=HEAD_DIM,
        index_topk=TOPK,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def _pair(dtype: torch.dtype = torch.float32) -> tuple[Any, Indexer]:
    """HF's indexer with random weights (LayerNorm too) and ours loaded from its state dict."""
    torch.manual_seed(0)
    hf = hf_v32.DeepseekV32Indexer(_config(), layer_idx=0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    ours = Indexer(IndexerArch.from_config(_config().to_dict()))
    ours.load_state_dict(hf.state_dict(), strict=True)  # the checkpoint maps by name
    hf.to(dtype)
    ours.to(dtype)
    hf.weights_proj.float()  # HF's _keep_in_fp32_modules in a bf16 model
    ours.weights_proj.float()
    return hf, ours


@contextmanager
def _captured_topk_inputs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[torch.Tensor]]:
    seen: list[torch.Tensor] = []
    real = torch.Tensor.topk

    def spy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append(self.detach().clone())
        return real(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "topk", spy)
        yield seen


@dataclass(frozen=True)
class _Gathered:
    """A stand-in for the attention seam's CausalContext (the GatheredKeys protocol)."""

    values: torch.Tensor  # [B, L, ...]
    mask: torch.Tensor  # [B, Q, L]
    rows: torch.Tensor  # [T]
    cols: torch.Tensor  # [T]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(*self.mask.shape[:2], *x.shape[1:])
        out[self.rows, self.cols] = x
        return out


def _gather(rows: list[tuple[torch.Tensor, int]], width: int = 0) -> _Gathered:
    """Sequences given as (all their keys [L_b, ...] incl. this step's, new tokens n_b), padded
    to max(L_b, width) with garbage (NaN, or NaN bytes in fp8) that must never be chosen."""
    length = max([width] + [k.shape[0] for k, _ in rows])
    q = max(n for _, n in rows)
    first = rows[0][0]
    garbage = torch.full((len(rows), length, *first.shape[1:]), 0x7F, dtype=torch.uint8)
    values = (
        garbage.view(first.dtype)
        if first.dtype == FP8_DTYPE
        else garbage.float().fill_(float("nan")).to(first.dtype)
    )
    mask = torch.zeros(len(rows), q, length, dtype=torch.bool)
    for b, (keys, n) in enumerate(rows):
        values[b, : keys.shape[0]] = keys
        first_pos = keys.shape[0] - n
        mask[b, :n] = torch.arange(length)[None, :] <= first_pos + torch.arange(n)[:, None]
    seq = torch.tensor([b for b, (_, n) in enumerate(rows) for _ in range(n)])
    col = torch.tensor([i for _, n in rows for i in range(n)])
    return _Gathered(values, mask, seq, col)


def _hf_mask(indices: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """HF's [S, k] choices (k = min(topk, keys)) as a [S, L] mask, cut to the causal keys."""
    chosen = torch.zeros(causal.shape, dtype=torch.bool)
    chosen.scatter_(1, indices.long(), True)
    return chosen & causal


def _ties_at_cut(scores: torch.Tensor, causal: torch.Tensor, topk: int) -> int:
    ties = 0
    for row, seen in zip(scores, causal, strict=True):
        if int(seen.sum()) > topk:
            top = row[seen].sort(descending=True).values
            ties += int(top[topk - 1] == top[topk])
    return ties


def _inputs(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, HIDDEN, generator=g).to(dtype)
    q_resid = torch.randn(n, Q_LORA, generator=g).to(dtype)
    return hidden, q_resid


def _tables(positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """HF's (cos, sin) [T, P] from its own rotary embedding, and the same as MLA's half tables
    [T, 1, P/2] (cat(freqs, freqs): the first half is all there is)."""
    rotary = hf_v32.DeepseekV32RotaryEmbedding(_config())
    cos, sin = rotary(torch.zeros(1, dtype=dtype), positions[None])
    return cos[0], sin[0], cos[0, :, None, : ROPE // 2], sin[0, :, None, : ROPE // 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_then_decode_match_hf(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    hf, ours = _pair(dtype)
    total = PROMPT + DECODES
    hidden, q_resid = _inputs(total, dtype, seed=1)
    hf_cos, hf_sin, cos, sin = _tables(torch.arange(total), dtype)
    cache = DynamicCache(config=_config())
    stored = torch.empty(0, HEAD_DIM, dtype=dtype)  # our sequence's index-K "pool"
    ties = 0
    # HF: one prefill of PROMPT tokens, then one token per step. Ours: the same steps.
    for lo, hi in [(0, PROMPT)] + [(p, p + 1) for p in range(PROMPT, total)]:
        new = slice(lo, hi)
        causal = torch.ones(1, hi - lo, hi, dtype=torch.bool).tril(lo)
        with _captured_topk_inputs(monkeypatch) as seen, torch.no_grad():
            pe = (hf_cos[None, new], hf_sin[None, new])
            hf_idx = hf(hidden[None, new], q_resid[None, new], pe, causal, None, cache=cache)[0]
        hf_scores = seen[0][0]  # [S, T]
        with torch.no_grad():
            stored = torch.cat((stored, ours.keys(hidden[new], cos[new], sin[new])))
            hf_keys = cache.layers[0].indexer_keys[0]  # type: ignore[union-attr]
            assert torch.equal(stored, hf_keys)  # the keys HF cached, exactly
            g = _gather([(stored, hi - lo)], width=hi + 3)  # 3 garbage keys past the end
            q, w = (
                g.pad(ours.queries(q_resid[new], cos[new], sin[new])),
                g.pad(ours.head_weights(hidden[new])),
            )
            scores = ours.scores(q, w, g.values, g.mask)[0, :, :hi]
            mask = ours(hidden[new], q_resid[new], cos[new], sin[new], g)[0]
        assert not mask[:, hi:].any()
        mask = mask[:, :hi]
        finite = torch.isfinite(scores)
        assert torch.equal(finite, causal[0])  # -inf exactly outside the causal context
        torch.testing.assert_close(scores[finite], hf_scores[finite], rtol=1e-5, atol=1e-5)
        assert torch.equal(mask, _hf_mask(hf_idx, causal[0])), f"step {lo}..{hi}"
        assert torch.equal(mask.sum(1), causal[0].sum(1).clamp(max=TOPK))  # dense below k
        ties += _ties_at_cut(hf_scores, causal[0], TOPK)
    assert ties == 0  # 16 heads: no exact ties at the cut, so HF's choice is well defined


def test_chunked_prefill_and_a_mixed_batch_match_hf_full_prefill() -> None:
    """Two sequences in one step: A decodes its 41st token, B prefills tokens 25..39 on top of
    25 cached keys; each equals HF's choice for those tokens in one full-prompt forward."""
    hf, ours = _pair()
    a_hidden, a_q = _inputs(PROMPT + 1, torch.float32, seed=2)
    b_hidden, b_q = _inputs(PROMPT, torch.float32, seed=3)
    hf_cos, hf_sin, cos, sin = _tables(torch.arange(PROMPT + 1), torch.float32)
    expected = []
    for h, qr in ((a_hidden, a_q), (b_hidden, b_q)):
        n = h.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        with torch.no_grad():
            idx = hf(h[None], qr[None], (hf_cos[None, :n], hf_sin[None, :n]), causal[None], None)
        expected.append(_hf_mask(idx[0], causal))
    with torch.no_grad():
        a_keys = ours.keys(a_hidden, cos, sin)  # all 41 (the 41st is this step's)
        b_keys = torch.cat(  # the first chunk's, cached earlier, then this step's
            (
                ours.keys(b_hidden[:25], cos[:25], sin[:25]),
                ours.keys(b_hidden[25:], cos[25:40], sin[25:40]),
            )
        )
        positions = torch.cat((torch.tensor([PROMPT]), torch.arange(25, PROMPT)))
        hidden = torch.cat((a_hidden[PROMPT:], b_hidden[25:]))
        q_resid = torch.cat((a_q[PROMPT:], b_q[25:]))
        g = _gather([(a_keys, 1), (b_keys, 15)])
        mask = ours(hidden, q_resid, cos[positions], sin[positions], g)
    assert mask.shape == (2, 15, PROMPT + 1)
    assert torch.equal(mask[0, 0], expected[0][PROMPT]) and not mask[0, 1:].any()
    assert torch.equal(mask[1, :, :PROMPT], expected[1][25:]) and not mask[1, :, PROMPT].any()


def test_select_is_dense_below_k_and_breaks_ties_by_lower_index() -> None:
    scores = torch.tensor([[1.0, 0.0, 0.0, 0.0, 2.0, 9.0], [0.0, 0.0, 0.0, 5.0, 5.0, 5.0]])
    causal = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    mask = select(scores, causal, topk=3)
    assert mask.int().tolist() == [[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]]
    big = torch.zeros(5000)  # long enough that an unstable sort would scramble the ties
    big[::7] = 1.0  # 715 ones, then the five lowest-index zeros fill the cut
    chosen = select(big[None], torch.ones(1, 5000, dtype=torch.bool), topk=720)[0]
    assert chosen.nonzero()[:, 0].tolist() == sorted(list(range(0, 5000, 7)) + [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="index_topk"):
        select(scores, causal, topk=0)


def test_index_k_buffers_in_both_modes() -> None:
    (auto,) = index_k_buffers(IndexKMode.AUTO, 128, "bfloat16")
    assert auto == BufferSpec("index_k", (128,), "bfloat16")
    key, scale = index_k_buffers(IndexKMode.FP8, 128, "bfloat16", layers=(1, 2))
    assert key == BufferSpec("index_k", (128,), "float8_e4m3fn", (1, 2))
    assert scale == BufferSpec("index_k_scale", (1,), "float32", (1, 2))
    latent = BufferSpec("latent", (1, 576), "bfloat16")
    layout = KVLayout((latent, key, scale), 64, 3)
    assert layout.region(1, "index_k").nbytes == 64 * 128
    assert layout.region(2, "index_k_scale").nbytes == 64 * 4
    other = KVLayout((latent, auto), 64, 3)
    assert layout.mismatch(other) == "buffer 'index_k' dtype: 'float8_e4m3fn' vs 'bfloat16'"


def test_quantize_index_k_scales_and_round_trip() -> None:
    g = torch.Generator().manual_seed(4)
    k = torch.randn(64, 128, generator=g) * torch.logspace(-3, 2, 64)[:, None]
    k[0] = 0.0  # an all-zero key: the absmax floor keeps its scale finite
    k[1, 5] = 1e4  # an outlier
    k[2] = k[2].clamp(-50, 50)
    k[2, 0] = 56.0  # absmax / 448 = 2**-3 exactly: a power of two is kept, not doubled
    for pow2 in (True, False):
        k8, scale = quantize_index_k(k, pow2_scale=pow2)
        assert k8.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (64,)
        for row, s in zip(k, scale.tolist(), strict=True):  # byte-checked, one key at a time
            amax = torch.tensor(max(float(row.abs().max()), 1e-4), dtype=torch.float32)
            plain = amax / FP8_MAX  # float32, as DeepSeek's act_quant computes it
            want = 2.0 ** math.ceil(math.log2(float(plain))) if pow2 else float(plain)
            assert struct.pack("<f", s) == struct.pack("<f", want)
        if pow2:  # rounded up to a power of two: the largest element lands in (224, 448]
            ratio = k[1:].abs().amax(1) / scale[1:]
            assert ((ratio > FP8_MAX / 2) & (ratio <= FP8_MAX)).all()
        back = dequantize_index_k(k8, scale)
        # e4m3: 3 mantissa bits (half-ulp 2**-4 relative), subnormal spacing 2**-9 of the scale
        assert ((back - k).abs() <= k.abs() / 16 + scale[:, None] / 1024).all()
        assert not k8.float().isnan().any()
        assert torch.equal(back[0], torch.zeros(128))
    rotated = hadamard_rotate(k[2:4])
    torch.testing.assert_close(rotated @ rotated.T, k[2:4] @ k[2:4].T, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_rotate(torch.ones(2, 24))


def _fp8_reference(
    ours: Indexer, q: torch.Tensor, w: torch.Tensor, k8: torch.Tensor, ks: torch.Tensor
) -> torch.Tensor:  # q [n, H, D], w [n, H], k8 [L, D], ks [L, 1] -> [n, L]
    """The fp8 mode's scores in plain float32: dequantise q and k, then HF's formula."""
    q8, qs = quantize_fp8(hadamard_rotate(q))
    q_deq = q8.float() * qs[..., None]
    k_deq = dequantize_index_k(k8, ks)
    logits = torch.relu(torch.einsum("nhd,ld->nhl", q_deq, k_deq) * ours.softmax_scale)
    return torch.einsum("nh,nhl->nl", w, logits)


def test_fp8_mode_matches_its_float32_reference() -> None:
    _, ours = _pair()
    n = PROMPT
    hidden, q_resid = _inputs(n, torch.float32, seed=5)
    _, _, cos, sin = _tables(torch.arange(n), torch.float32)
    with torch.no_grad():
        entries = index_k_for_cache(ours.keys(hidden, cos, sin), IndexKMode.FP8)
        k8, ks = entries["index_k"], entries["index_k_scale"]
        assert k8.dtype == FP8_DTYPE and ks.shape == (n, 1)
        keys, scales = _gather([(k8, n)], width=n + 2), _gather([(ks, n)], width=n + 2)
        mask = ours(hidden, q_resid, cos, sin, keys, scales)[0]
        q, w = ours.queries(q_resid, cos, sin), ours.head_weights(hidden)
        scores = ours.scores(
            keys.pad(q), keys.pad(w), keys.values, keys.mask, scales.values[..., 0]
        )
        ref = _fp8_reference(ours, q, w, k8, ks)
    causal = keys.mask[0, :, :n]
    assert torch.equal(torch.isfinite(scores[0]), keys.mask[0])  # garbage keys stay -inf
    torch.testing.assert_close(scores[0, :, :n][causal], ref[causal], rtol=1e-5, atol=1e-6)
    assert torch.equal(mask[:, :n], select(ref, causal, TOPK)) and not mask[:, n:].any()


def test_report_fp8_against_bf16_selections() -> None:
    """Reported, not asserted equal: how often fp8 index-K changes a bf16 model's choices."""
    _, ours = _pair(torch.bfloat16)
    swapped = rows_differing = rows = 0
    for seed in range(4):
        hidden, q_resid = _inputs(PROMPT, torch.bfloat16, seed=10 + seed)
        _, _, cos, sin = _tables(torch.arange(PROMPT), torch.bfloat16)
        with torch.no_grad():
            k = ours.keys(hidden, cos, sin)
            masks = []
            for mode in IndexKMode:
                e = index_k_for_cache(k, mode)
                keys = _gather([(e["index_k"], PROMPT)])
                scales = _gather([(e["index_k_scale"], PROMPT)]) if "index_k_scale" in e else None
                masks.append(ours(hidden, q_resid, cos, sin, keys, scales)[0])
        causal_lens = torch.arange(PROMPT) + 1
        for m in masks:  # both are valid selections: min(k, causal) causal keys per token
            assert torch.equal(m.sum(1), causal_lens.clamp(max=TOPK))
        sparse = causal_lens > TOPK
        diff = (masks[0] != masks[1])[sparse]
        swapped += int(diff.sum()) // 2
        rows_differing += int(diff.any(1).sum())
        rows += int(sparse.sum())
    print(
        f"\nfp8 vs bf16 index-K: {rows_differing}/{rows} sparse rows choose differently; "
        f"{swapped}/{rows * TOPK} chosen keys swapped"
    )


def test_selections_inside_hf_generate(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's whole DeepseekV32ForCausalLM.generate (2 layers, a 40-token prompt, 4 new tokens):
    every indexer call's inputs are recorded, and ours, fed the same inputs with its own
    per-layer key store, chooses exactly what HF chose."""
    from transformers import DeepseekV32ForCausalLM

    cfg = _config()
    cfg.num_hidden_layers, cfg.first_k_dense_replace = 2, 2
    cfg.mlp_layer_types, cfg.layer_types = ["dense"] * 2, ["indexed_attention"] * 2
    torch.manual_seed(6)
    model = DeepseekV32ForCausalLM(cfg).eval()
    calls: list[
        tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    ] = []
    real = hf_v32.DeepseekV32Indexer.forward

    def spy(
        self: Any,
        hidden: torch.Tensor,
        q_resid: torch.Tensor,
        pe: Any,
        mask: Any,
        pos: Any,
        cache: Any = None,
    ) -> torch.Tensor:
        idx = real(self, hidden, q_resid, pe, mask, pos, cache=cache)
        calls.append((self.layer_idx, hidden[0], q_resid[0], pe[0][0], pe[1][0], idx[0]))
        return idx

    monkeypatch.setattr(hf_v32.DeepseekV32Indexer, "forward", spy)
    model.generate(torch.randint(0, 128, (1, PROMPT)), max_new_tokens=DECODES, do_sample=False)
    assert len(calls) == 2 * DECODES  # a prefill and DECODES - 1 decode steps, per layer
    stored = {0: torch.empty(0, HEAD_DIM), 1: torch.empty(0, HEAD_DIM)}
    for layer, hidden, q_resid, hf_cos, hf_sin, hf_idx in calls:
        ours = Indexer(IndexerArch.from_config(cfg.to_dict()))
        ours.load_state_dict(model.model.layers[layer].self_attn.indexer.state_dict())
        cos, sin = hf_cos[:, None, : ROPE // 2], hf_sin[:, None, : ROPE // 2]
        with torch.no_grad():
            stored[layer] = torch.cat((stored[layer], ours.keys(hidden, cos, sin)))
            g = _gather([(stored[layer], hidden.shape[0])])
            mask = ours(hidden, q_resid, cos, sin, g)[0]
        assert torch.equal(mask, _hf_mask(hf_idx, g.mask[0]))
