"""Deterministic random weights for the built-in models, written as safetensors.

Each tensor is drawn from numpy's PCG64 seeded by SHA-256 of "model/tensor name" (never
torch.randn, whose vectorised code differs by CPU), so the bytes are the same on every machine
and Python version. The scales make greedy decoding clearly peaked (see test_builtin).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors.torch import save_file

if TYPE_CHECKING:
    from pdserve.model.builtin_specs import BuiltinSpec


def write_json(path: Path, obj: dict[str, object]) -> None:
    """Stable bytes: sorted keys, fixed indent, UTF-8."""
    path.write_text(
        json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )


# Chosen by measuring greedy decoding of the tiny models with HF transformers: top-1 vs top-2
# logit gaps stay above ~0.01 while outputs still vary with the prompt (test_builtin checks).
_LOGIT_STD = 18.0
# With tied embeddings the logit of the last input token gets |embedding|^2 for free, so the
# residual branches must outweigh the embedding or greedy decoding just repeats that token.
_TIED_RESIDUAL_GAIN = 6.0


@dataclass(frozen=True)
class _Init:
    shape: tuple[int, ...]
    std: float
    mean: float = 0.0


@dataclass(frozen=True)
class _ExpertIds:
    """An int64 [rows, k] table of distinct expert ids per row (V4's tid2eid)."""

    rows: int
    k: int
    experts: int


def _deepseek_layer_inits(spec: BuiltinSpec, i: int) -> dict[str, _Init]:
    """DeepSeek-V3's layer i, with per-expert tensors as HF's save_pretrained writes them."""
    d = spec.deepseek
    assert d is not None
    h, heads = spec.hidden_size, spec.num_heads
    qk, latent = d.qk_nope_head_dim + d.qk_rope_head_dim, d.kv_lora_rank + d.qk_rope_head_dim
    p = f"model.layers.{i}."
    a = p + "self_attn."
    inits = {
        a + "q_a_proj.weight": _Init((d.q_lora_rank, h), h**-0.5),
        a + "q_a_layernorm.weight": _Init((d.q_lora_rank,), 0.05, 1.0),
        a + "q_b_proj.weight": _Init((heads * qk, d.q_lora_rank), d.q_lora_rank**-0.5),
        a + "kv_a_proj_with_mqa.weight": _Init((latent, h), h**-0.5),
        a + "kv_a_layernorm.weight": _Init((d.kv_lora_rank,), 0.05, 1.0),
        a + "kv_b_proj.weight": _Init(
            (heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank), d.kv_lora_rank**-0.5
        ),
        a + "o_proj.weight": _Init((h, heads * d.v_head_dim), (heads * d.v_head_dim) ** -0.5),
        p + "input_layernorm.weight": _Init((h,), 0.05, 1.0),
        p + "post_attention_layernorm.weight": _Init((h,), 0.05, 1.0),
    }
    if d.index_topk is not None:  # V3.2's indexer
        assert d.index_n_heads is not None and d.index_head_dim is not None
        n, k = d.index_n_heads, d.index_head_dim
        inits[a + "indexer.wq_b.weight"] = _Init((n * k, d.q_lora_rank), d.q_lora_rank**-0.5)
        inits[a + "indexer.wk.weight"] = _Init((k, h), h**-0.5)
        inits[a + "indexer.k_norm.weight"] = _Init((k,), 0.05, 1.0)
        inits[a + "indexer.k_norm.bias"] = _Init((k,), 0.05)
        inits[a + "indexer.weights_proj.weight"] = _Init((n, h), h**-0.5)
    mlps = {"mlp.": spec.intermediate_size}
    if i >= d.first_k_dense_replace:
        # Correction biases of 0.3 std move the choice, not the weights (HF: scores unbiased).
        inits[p + "mlp.gate.weight"] = _Init((d.n_routed_experts, h), h**-0.5)
        inits[p + "mlp.gate.e_score_correction_bias"] = _Init((d.n_routed_experts,), 0.3)
        mlps = {f"mlp.experts.{e}.": d.moe_intermediate_size for e in range(d.n_routed_experts)}
        mlps["mlp.shared_experts."] = d.moe_intermediate_size * d.n_shared_experts
    for prefix, ff in mlps.items():
        inits[p + prefix + "gate_proj.weight"] = _Init((ff, h), h**-0.5)
        inits[p + prefix + "up_proj.weight"] = _Init((ff, h), h**-0.5)
        inits[p + prefix + "down_proj.weight"] = _Init((h, ff), ff**-0.5)
    return inits


def _deepseek_v4_layer_inits(spec: BuiltinSpec, i: int) -> dict[str, _Init | _ExpertIds]:
    """DeepSeek-V4's layer i in HF's in-memory names (what from_pretrained also loads)."""
    d = spec.deepseek_v4
    assert d is not None
    h, heads, hd = spec.hidden_size, spec.num_heads, spec.head_dim
    kind = d.layer_types[i]
    p = f"model.layers.{i}."
    a = p + "self_attn."
    per_group, o_rank = heads * hd // d.o_groups, d.o_groups * d.o_lora_rank
    inits: dict[str, _Init | _ExpertIds] = {
        a + "q_a_proj.weight": _Init((d.q_lora_rank, h), h**-0.5),
        a + "q_a_norm.weight": _Init((d.q_lora_rank,), 0.05, 1.0),
        a + "q_b_proj.weight": _Init((heads * hd, d.q_lora_rank), d.q_lora_rank**-0.5),
        a + "kv_proj.weight": _Init((hd, h), h**-0.5),
        a + "kv_norm.weight": _Init((hd,), 0.05, 1.0),
        a + "o_a_proj.weight": _Init((o_rank, per_group), per_group**-0.5),
        a + "o_b_proj.weight": _Init((h, o_rank), o_rank**-0.5),
        a + "sinks": _Init((heads,), 1.0),
        p + "input_layernorm.weight": _Init((h,), 0.05, 1.0),
        p + "post_attention_layernorm.weight": _Init((h,), 0.05, 1.0),
    }  # fmt: skip
    # The compressors: CSA's pairs two series (2 * head_dim) and carries the indexer.
    if kind != "sliding_attention":
        csa = kind == "compressed_sparse_attention"
        ratio, width = (d.csa_ratio, 2 * hd) if csa else (d.hca_ratio, hd)
        parts = [(a + "compressor.", width, hd, ratio)]
        if csa:
            ix_width = 2 * d.index_head_dim
            parts.append((a + "compressor.indexer.", ix_width, d.index_head_dim, d.csa_ratio))
        for c, w, dim, r in parts:
            inits[c + "kv_proj.weight"] = _Init((w, h), h**-0.5)
            inits[c + "gate_proj.weight"] = _Init((w, h), h**-0.5)
            inits[c + "position_bias"] = _Init((r, w), 0.5)
            inits[c + "kv_norm.weight"] = _Init((dim,), 0.05, 1.0)
        if csa:
            ix, n, r = a + "compressor.indexer.", d.index_n_heads, d.q_lora_rank
            inits[ix + "q_b_proj.weight"] = _Init((n * d.index_head_dim, r), r**-0.5)
            inits[ix + "scorer.weights_proj.weight"] = _Init((n, h), h**-0.5)
    e, ff = d.n_routed_experts, d.moe_intermediate_size
    m = p + "mlp."
    inits[m + "gate.weight"] = _Init((e, h), h**-0.5)
    if d.mlp_layer_types[i] == "hash_moe":
        inits[m + "gate.tid2eid"] = _ExpertIds(spec.vocab_size, d.num_experts_per_tok, e)
    else:  # 0.3 std moves the choice, not the weights (HF: scores unbiased)
        inits[m + "gate.e_score_correction_bias"] = _Init((e,), 0.3)
    inits[m + "experts.gate_up_proj"] = _Init((e, 2 * ff, h), h**-0.5)
    inits[m + "experts.down_proj"] = _Init((e, h, ff), ff**-0.5)
    inits[m + "shared_experts.gate_proj.weight"] = _Init((ff, h), h**-0.5)
    inits[m + "shared_experts.up_proj.weight"] = _Init((ff, h), h**-0.5)
    inits[m + "shared_experts.down_proj.weight"] = _Init((h, ff), ff**-0.5)
    # Hyper-connections: unit-scale mixes of the normed streams, varied biases and scales.
    n = d.hc_mult
    for hc in ("attn_hc.", "ffn_hc."):
        inits[p + hc + "fn"] = _Init(((2 + n) * n, n * h), (n * h) ** -0.5)
        inits[p + hc + "base"] = _Init(((2 + n) * n,), 0.5)
        inits[p + hc + "scale"] = _Init((3,), 0.1, 1.0)
    return inits


def _layer_inits(spec: BuiltinSpec, i: int) -> dict[str, _Init | _ExpertIds]:
    if spec.deepseek_v4 is not None:
        return _deepseek_v4_layer_inits(spec, i)
    if spec.deepseek is not None:
        return dict(_deepseek_layer_inits(spec, i))
    h, q, kv, ff = (
        spec.hidden_size,
        spec.num_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
        spec.intermediate_size,
    )
    p = f"model.layers.{i}."
    # 1/sqrt(fan_in) keeps a projection's output at unit scale; see _TIED_RESIDUAL_GAIN for
    # the two that write into the residual stream.
    gain = _TIED_RESIDUAL_GAIN if spec.tie_word_embeddings else 1.0
    inits: dict[str, _Init | _ExpertIds] = {
        p + "self_attn.q_proj.weight": _Init((q, h), h**-0.5),
        p + "self_attn.k_proj.weight": _Init((kv, h), h**-0.5),
        p + "self_attn.v_proj.weight": _Init((kv, h), h**-0.5),
        p + "self_attn.o_proj.weight": _Init((h, q), gain * q**-0.5),
        p + "mlp.gate_proj.weight": _Init((ff, h), h**-0.5),
        p + "mlp.up_proj.weight": _Init((ff, h), h**-0.5),
        p + "mlp.down_proj.weight": _Init((h, ff), gain * ff**-0.5),
        p + "input_layernorm.weight": _Init((h,), 0.05, 1.0),
        p + "post_attention_layernorm.weight": _Init((h,), 0.05, 1.0),
    }  # fmt: skip
    if spec.qkv_bias:
        for proj, rows in (("q", q), ("k", kv), ("v", kv)):
            inits[p + f"self_attn.{proj}_proj.bias"] = _Init((rows,), 0.2)
    if spec.qk_norm:
        for proj in ("q", "k"):
            inits[p + f"self_attn.{proj}_norm.weight"] = _Init((spec.head_dim,), 0.05, 1.0)
    return inits


def _shard_inits(spec: BuiltinSpec) -> list[dict[str, _Init | _ExpertIds]]:
    """Tensor inits grouped by shard: embeddings with the first layers, the head with the last."""
    # Logit std ~ 18 whatever the width: peaked next-token distributions, so greedy decoding
    # rarely meets a near-tie that float rounding could flip between implementations.
    head_std = _LOGIT_STD / math.sqrt(spec.hidden_size)
    per_shard = spec.num_layers // spec.num_shards
    shards: list[dict[str, _Init | _ExpertIds]] = [{} for _ in range(spec.num_shards)]
    shards[0]["model.embed_tokens.weight"] = _Init((spec.vocab_size, spec.hidden_size), head_std)
    for i in range(spec.num_layers):
        shards[i // per_shard].update(_layer_inits(spec, i))
    shards[-1]["model.norm.weight"] = _Init((spec.hidden_size,), 0.05, 1.0)
    if spec.deepseek_v4 is not None:  # the head's hyper-connection
        n, h = spec.deepseek_v4.hc_mult, spec.hidden_size
        shards[-1]["model.hc_head.hc_fn"] = _Init((n, n * h), (n * h) ** -0.5)
        shards[-1]["model.hc_head.hc_base"] = _Init((n,), 0.5)
        shards[-1]["model.hc_head.hc_scale"] = _Init((1,), 0.1, 1.0)
    if not spec.tie_word_embeddings:
        shards[-1]["lm_head.weight"] = _Init((spec.vocab_size, spec.hidden_size), head_std)
    return shards


def write_weights(spec: BuiltinSpec, out_dir: Path) -> None:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype]
    shards = _shard_inits(spec)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for k, inits in enumerate(shards, start=1):
        filename = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {
            n: _expert_ids(f"{spec.name}/{n}", init)
            if isinstance(init, _ExpertIds)
            else _random_tensor(f"{spec.name}/{n}", init, dtype)
            for n, init in sorted(inits.items())
        }
        if spec.fp8:
            tensors = fp8_checkpoint(tensors)
        save_file(tensors, str(out_dir / filename), metadata={"format": "pt"})
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, filename))
        del tensors  # one shard in memory at a time
    if len(shards) > 1:
        write_json(
            out_dir / "model.safetensors.index.json",
            {"metadata": {"total_size": total_bytes}, "weight_map": weight_map},
        )


# DeepSeek's fp8 checkpoints quantise every projection; norms, the router, the indexer's
# head weights, the embeddings and the head stay in the model dtype.
FP8_STORED = re.compile(
    r".*\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj"
    r"|indexer\.wq_b|indexer\.wk)\.weight"
)
# config.json's quantization_config of such a checkpoint (DeepSeek-V3's own).
FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}  # fmt: skip


def fp8_checkpoint(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A DeepSeek checkpoint's tensors in its fp8 format: the projections as float8_e4m3fn
    with their float32 `weight_scale_inv` blocks, the rest as they are."""
    from pdserve.kernels.fp8_blocks import quantize_weight

    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if FP8_STORED.fullmatch(name) and t.dim() == 2:
            out[name], out[name + "_scale_inv"] = quantize_weight(t)
        else:
            out[name] = t
    return out


_CHUNK = 1 << 22  # values per numpy step: bounds the temporaries to a few 16 MiB arrays
_BYTE_MASK = np.uint32(0x00FF00FF)
# Sum of four uniform bytes: mean 4 * 127.5, variance 4 * (256**2 - 1) / 12.
_SUM4_MEAN = np.float32(510.0)
_SUM4_STD = math.sqrt(4 * (256**2 - 1) / 12)


def _expert_ids(key: str, init: _ExpertIds) -> torch.Tensor:
    """[rows, k] int64, each row k distinct ids in [0, experts): a partial Fisher-Yates
    shuffle per row driven by the same seeded raw stream as the weights (integer steps
    only, so identical everywhere)."""
    seed = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "little")
    words = np.random.PCG64(seed).random_raw(init.rows * init.k).astype("<u8", copy=False)
    words = words.reshape(init.rows, init.k)
    perm = np.tile(np.arange(init.experts, dtype=np.int64), (init.rows, 1))
    rows = np.arange(init.rows)
    for j in range(init.k):
        pick = j + (words[:, j] % np.uint64(init.experts - j)).astype(np.int64)
        chosen = perm[rows, pick].copy()
        perm[rows, pick] = perm[:, j]
        perm[:, j] = chosen
    return torch.from_numpy(np.ascontiguousarray(perm[:, : init.k]))


def _random_tensor(key: str, init: _Init, dtype: torch.dtype) -> torch.Tensor:
    """Approximately N(mean, std^2) values (Irwin-Hall of four bytes, within +-3.45 std),
    bit-identical on every platform (see module doc)."""
    seed = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "little")
    bits = np.random.PCG64(seed)
    n = math.prod(init.shape)
    scale = np.float32(init.std / _SUM4_STD)
    mean = np.float32(init.mean)
    out = np.empty(n, dtype=np.float32)
    for start in range(0, n, _CHUNK):
        count = min(_CHUNK, n - start)
        # "<u4" fixes which half of each 64-bit draw comes first, whatever the host byte order.
        words = bits.random_raw((count + 1) // 2).astype("<u8", copy=False).view("<u4")[:count]
        # SWAR: add the bytes pairwise inside the word, then the two 16-bit halves.
        pairs = words & _BYTE_MASK
        pairs += (words >> np.uint32(8)) & _BYTE_MASK
        sums = (pairs & np.uint32(0xFFFF)) + (pairs >> np.uint32(16))
        values = out[start : start + count]
        values[:] = sums  # exact: sums <= 1020
        values -= _SUM4_MEAN
        values *= scale
        values += mean
    return torch.from_numpy(out).reshape(init.shape).to(dtype)
