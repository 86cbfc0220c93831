"""DeepSeek-V4's checkpoint names onto the model's parameters (a table of model/weight_map.py)."""

from __future__ import annotations

from pdserve.model.weight_rules import LAYER, Ignore, Rename, Rewrite, Rule, Stack, StackConcat

# DeepSeek-V4 (model/deepseek_v4/): HF's in-memory names are the parameters' own. DeepSeek's
# checkpoints use DeepSeek's names, and HF's save_pretrained writes back whichever of them its
# load converted, so a file may mix both. As HF does (transformers' conversion_mapping.py),
# every name is rewritten step by step, without its "model." prefix, by each substitution in
# turn; the result, prefixed again, is ours.
REWRITES: tuple[tuple[str, str], ...] = (
    (r"^model\.", ""),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)", r".\1_hc.\2"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"^(?!lm_head\.)", "model."),
)
EXPERT = rf"{LAYER}\.mlp\.experts\.(?P<expert>\d+)"
DEEPSEEK_V4_RULES: tuple[Rule, ...] = (
    *(Rewrite(source, target) for source, target in REWRITES),
    Ignore(r".*rotary_emb\.\w*inv_freq"),
    StackConcat(
        tuple(rf"{EXPERT}\.{w}\.weight" for w in ("w1", "w3")),  # gate, then up
        r"\1.mlp.experts.gate_up_proj",
    ),
    Stack(rf"{EXPERT}\.w2\.weight", r"\1.mlp.experts.down_proj"),
    Rename(r"(.*)", r"\1"),
)
