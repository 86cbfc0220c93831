"""Write a DeepSeek-V4 checkpoint for tests the way DeepSeek-V4-Flash ships its own: from
deepseek-v4-tiny (transformers' names, float32), quantised.

  * DeepSeek's tensor names (`layers.N.attn.wq_a.weight`, `embed.weight`, `hc_head_fn`, ...:
    the inverse of transformers' conversion, conversion_mapping.py "deepseek_v4");
  * the linear weights of attention, the indexer's wq_b and the shared experts in fp8 e4m3,
    each with an E8M0 `X.scale` (safetensors F8_E8M0) per 128 x 128 block;
  * the routed experts (`ffn.experts.E.w1/w2/w3`) in fp4 e2m1, two values a byte stored as I8
    (low nibble first), with an E8M0 `X.scale` per 32 values of a row;
  * the compressor's and indexer's wkv / wgate and the indexer's weights_proj in bf16 without
    scales (transformers' `_keep_in_fp32_modules` names them), as are the embedding, the head
    and the routers; norms, mHC, sinks and position biases float32, tid2eid int64;
  * Flash's config.json: its `quantization_config` and top-level `expert_dtype: "fp4"`, and
    one multi-token prediction module (`mtp.0.*`, quantised too), which loaders skip;
  * two shards with an index, layer 2's scales in the other shard from their weights.
The quantiser is this file's own (a power-of-two scale per block, just above amax / the
format's largest value; values rounded to nearest): any rounding gives a valid checkpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}
FP8_BLOCK, FP4_BLOCK = 128, 32
E4M3_MAX, E2M1_MAX = 448.0, 6.0
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

# transformers' names -> DeepSeek's, substituted in order.
DEEPSEEK_NAMES = (
    (r"^model\.", ""),
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.shared_experts\.gate_proj\.", ".ffn.shared_experts.w1."),
    (r"\.mlp\.shared_experts\.down_proj\.", ".ffn.shared_experts.w2."),
    (r"\.mlp\.shared_experts\.up_proj\.", ".ffn.shared_experts.w3."),
    (r"\.mlp\.", ".ffn."),
    (r"\.kv_norm\.", ".norm."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.sinks$", ".attn_sink"),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
)
FP8_LINEAR = re.compile(
    r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])"
    r"\.weight"
)  # the compressor's and indexer's wkv / wgate are not among them: `attn.` directly
BF16 = re.compile(
    r"embed\.weight|head\.weight|.*\.ffn\.gate\.weight|.*\.(wkv|wgate|weights_proj)\.weight"
)


def deepseek_name(hf_name: str) -> str:
    for pattern, repl in DEEPSEEK_NAMES:
        hf_name = re.sub(pattern, repl, hf_name)
    return hf_name


def e8m0(amax: torch.Tensor, largest: float) -> torch.Tensor:
    """The E8M0 byte of the smallest power of two s with amax / s <= largest."""
    e = torch.ceil(torch.log2(amax.clamp(min=2.0**-100) / largest))
    return (e + 127).clamp(0, 254).to(torch.uint8)


def quantise_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, N] -> (float8_e4m3fn [M, N], float8_e8m0fnu [ceil(M / 128), ceil(N / 128)])."""
    m, n = w.shape
    rows, cols = -(-m // FP8_BLOCK), -(-n // FP8_BLOCK)
    padded = torch.zeros(rows * FP8_BLOCK, cols * FP8_BLOCK)
    padded[:m, :n] = w
    blocks = padded.view(rows, FP8_BLOCK, cols, FP8_BLOCK)
    scale = e8m0(blocks.abs().amax(dim=(1, 3)), E4M3_MAX)  # [rows, cols]
    step = scale.view(torch.float8_e8m0fnu).float()  # 2^(e - 127)
    q = (blocks / step[:, None, :, None]).view_as(padded)[:m, :n]
    return q.to(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)


def quantise_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, N] -> (int8 [M, N / 2], two e2m1 codes a byte, low nibble first; float8_e8m0fnu
    [M, N / 32])."""
    m, n = w.shape
    blocks = w.reshape(m, n // FP4_BLOCK, FP4_BLOCK)
    scale = e8m0(blocks.abs().amax(dim=-1), E2M1_MAX)  # [M, N / 32]
    x = blocks / scale.view(torch.float8_e8m0fnu).float()[..., None]
    code = (x.abs()[..., None] - E2M1_MAGNITUDES).abs().argmin(dim=-1) | ((x < 0).long() << 3)
    code = code.reshape(m, n).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.view(torch.int8), scale.view(torch.float8_e8m0fnu)


def deepseek_tensors(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' tensors of a V4 model as DeepSeek-V4-Flash stores them."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            layer = deepseek_name(name.split(".mlp.")[0])
            for e in range(t.shape[0]):
                half = t.shape[1] // 2
                parts = (
                    {"w1": t[e, :half], "w3": t[e, half:]}
                    if name.endswith("gate_up_proj")
                    else {"w2": t[e]}
                )
                for w, part in parts.items():
                    prefix = f"{layer}.ffn.experts.{e}.{w}"
                    out[prefix + ".weight"], out[prefix + ".scale"] = quantise_fp4(part)
            continue
        ds = deepseek_name(name)
        if FP8_LINEAR.fullmatch(ds):
            out[ds], out[ds.removesuffix("weight") + "scale"] = quantise_fp8(t)
        elif BF16.fullmatch(ds):
            out[ds] = t.to(torch.bfloat16)
        else:
            out[ds] = t
    return out


def write_v4_flash(src: Path, out: Path) -> Path:
    """`src` (deepseek-v4-tiny's directory) written to `out` as DeepSeek-V4-Flash's checkpoints
    are; returns `out`."""
    tensors = deepseek_tensors(load_file(str(src / "model.safetensors")))
    mtp = "mtp.0.attn.wq_a", "mtp.0.ffn.experts.0.w2"  # multi-token prediction: never run
    tensors[mtp[0] + ".weight"], tensors[mtp[0] + ".scale"] = quantise_fp8(torch.ones(64, 128))
    tensors[mtp[1] + ".weight"], tensors[mtp[1] + ".scale"] = quantise_fp4(torch.ones(128, 64))
    second = {
        n for n in tensors
        if not n.startswith(("layers.0.", "layers.1.", "layers.2.", "mtp."))
        or (n.startswith("layers.2.") and n.endswith(".scale"))
    }  # fmt: skip
    shards: dict[str, dict[str, torch.Tensor]] = {
        "model-00001-of-00002.safetensors": {},
        "model-00002-of-00002.safetensors": {},
    }
    first_name, second_name = shards
    for n, t in tensors.items():
        shards[second_name if n in second else first_name][n] = t.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    for file, part in shards.items():
        save_file(part, str(out / file), metadata={"format": "pt"})
    weight_map = {n: f for f, part in shards.items() for n in part}
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((src / "config.json").read_text())
    cfg |= {
        "quantization_config": QUANTIZATION_CONFIG,
        "expert_dtype": "fp4",
        "num_nextn_predict_layers": 1,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
