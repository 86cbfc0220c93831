"""Write GGUF files for tests: an HF Llama or Qwen2 model and a byte-level tokenizer.json laid out
as llama.cpp's converter (convert_hf_to_gguf.py) lays them out: llama.cpp's tensor names, each
head's q/k rows permuted for Llama (its RoPE rotates adjacent pairs), Llama 3's rope scaling as
`rope_freqs.weight`, a tied output projection left out, the tokenizer as `tokenizer.ggml.*`.

Each tensor is stored in the type `types` picks by its llama.cpp name (default F32): quantised by
gguf.quants where gguf can; the K-quants, which it can only dequantise, get random blocks whose
scales keep the values small and centred (their values then come from the file, not the model).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

Q = GGMLQuantizationType
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)

_GGUF_NAMES = (
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"blk.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"blk.\1.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.(weight|bias)", r"blk.\1.attn_\2.\3"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", r"blk.\1.attn_output.\2"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.(weight|bias)", r"blk.\1.ffn_\2.\3"),
)


def gguf_name(hf_name: str) -> str:
    for pattern, template in _GGUF_NAMES:
        if re.fullmatch(pattern, hf_name):
            return re.sub(pattern, template, hf_name)
    raise KeyError(hf_name)


def permute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The converter's permutation: per head, rows [2, D/2] (HF's halves) become [D/2, 2]."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_fields(cfg: Any) -> dict[str, Any]:
    """An HF config's rope fields, theta included (transformers 5 `rope_parameters`, or 4's)."""
    return getattr(cfg, "rope_parameters", None) or {
        **(getattr(cfg, "rope_scaling", None) or {}),
        "rope_theta": getattr(cfg, "rope_theta", 10000.0),
    }


def llama3_rope_divisors(cfg: Any) -> torch.Tensor:
    """What the converter stores as rope_freqs.weight for HF's llama3 rope scaling."""
    rs, dim = rope_fields(cfg), cfg.head_dim
    freqs = 1.0 / (rs["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def random_k_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, bytes] of random `qtype` blocks whose scales give values of about +-0.3, centred."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    d = 2.0**-9 if qtype != Q.Q6_K else 2.0**-13

    def f16(x: float) -> np.ndarray:
        return np.array([x], dtype=np.float16).view(np.uint8)

    if qtype == Q.Q6_K:  # ql, qh, int8 scales, then d
        raw[..., size - 2 : size] = f16(d)
    else:  # d, dmin first; dmin * mean(q) cancels d's mean: q is 4 bits (Q4_K) or 5 (Q5_K)
        raw[..., 0:2] = f16(d)
        raw[..., 2:4] = f16(d * (7.5 if qtype == Q.Q4_K else 15.5))
    return raw.reshape(rows, -1)


def write_gguf(
    path: Path,
    model: torch.nn.Module,
    tokenizer_json: str,
    *,
    chat_template: str | None = None,
    bos: str | None = None,
    eos: str | None = None,
    add_bos: bool | None = False,  # None: the key left out (llama.cpp's default applies)
    pre: str = "qwen2",
    types: dict[str, GGMLQuantizationType] | None = None,
    name: str = "test model",
    file_type: int = 0,  # llama.cpp's LlamaFileType: 0 all F32, 1 mostly F16, 7 mostly Q8_0, ...
) -> Path:
    """Write `model` (an HF LlamaForCausalLM or Qwen2ForCausalLM) and the tokenizer as `path`.
    `types`: regex over llama.cpp tensor names -> storage type (first match; default F32)."""
    cfg = model.config
    arch = {"llama": "llama", "qwen2": "qwen2"}[cfg.model_type]
    w = GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    rope = rope_fields(cfg)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(file_type)
    _add_tokenizer(w, tokenizer_json, chat_template, bos, eos, add_bos, pre)

    tensors = {n: t.detach().float() for n, t in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for hf, t in tensors.items():
        if arch == "llama" and re.search(r"\.(q|k)_proj\.", hf):
            heads = cfg.num_attention_heads if ".q_proj." in hf else cfg.num_key_value_heads
            t = permute_rope_rows(t, heads)
        name_ = gguf_name(hf)
        qtype = next((q for p, q in (types or {}).items() if re.fullmatch(p, name_)), Q.F32)
        _add(w, name_, t.numpy(), qtype, seed=len(name_) * 7919 + sum(map(ord, name_)))
    if (rope.get("rope_type") or "default") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_divisors(cfg).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add(w: GGUFWriter, name: str, t: np.ndarray, qtype: GGMLQuantizationType, seed: int) -> None:
    if qtype in (Q.F32, Q.F16) or t.ndim == 1:
        w.add_tensor(name, t.astype(np.float16 if qtype == Q.F16 else np.float32))
    elif qtype in K_QUANTS:
        w.add_tensor(name, random_k_blocks(qtype, *t.shape, seed=seed), raw_dtype=qtype)
    else:
        w.add_tensor(name, quantize(t.astype(np.float32), qtype), raw_dtype=qtype)


def _add_tokenizer(
    w: GGUFWriter,
    tokenizer_json: str,
    chat_template: str | None,
    bos: str | None,
    eos: str | None,
    add_bos: bool | None,
    pre: str,
) -> None:
    tj = json.loads(tokenizer_json)
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    control = {a["id"] for a in tj["added_tokens"] if a["special"]}
    by_id |= {a["id"]: a["content"] for a in tj["added_tokens"]}
    tokens = [by_id[i] for i in range(len(by_id))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if i in control else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    if bos is not None:
        w.add_bos_token_id(tokens.index(bos))
    if eos is not None:
        w.add_eos_token_id(tokens.index(eos))
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
