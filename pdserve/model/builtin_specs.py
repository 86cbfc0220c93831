"""The shapes of the built-in models (what `builtin:NAME` and `pdserve make-model` build).

Everything else about a built-in model (its weights, its tokenizer, its HF files) is derived
from its spec, deterministically: model/builtin.py writes the directory, model/builtin_weights.py
the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pdserve.model.corpus import TOKENIZER_VOCAB

BUILTIN_NAMES: tuple[str, ...] = (
    "tiny",
    "qwen2-tiny",
    "qwen3-tiny",
    "qwen2-0.5b-shape",
    "llama3.2-1b-shape",
    "deepseek-v3-tiny",
    "deepseek-v32-tiny",
    "deepseek-v4-tiny",
    "deepseek-v3-fp8-tiny",
)


@dataclass(frozen=True)
class DeepseekShape:
    """DeepSeek-V3's own fields (HF's names): latent attention and the experts."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_group: int
    topk_group: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    # DeepSeek-V3.2's indexer (None: a V3 model; these fields are then not written)
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None


@dataclass(frozen=True)
class DeepseekV4Shape:
    """DeepSeek-V4's own fields (HF's names)."""

    q_lora_rank: int
    partial_rotary_factor: float
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    sliding_window: int
    compress_rope_theta: float
    compress_yarn: dict[str, Any]  # the compress table's YaRN (factor, original context, betas)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    csa_ratio: int = 4  # compress_rates, HF's defaults
    hca_ratio: int = 128


@dataclass(frozen=True)
class BuiltinSpec:
    """The shape of one built-in model; everything else (weights, tokenizer) is derived."""

    name: str
    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    dtype: str  # "float32" or "bfloat16": both the stored tensors and config torch_dtype
    vocab_size: int = TOKENIZER_VOCAB
    rope_scaling: dict[str, Any] | None = None
    add_bos: bool = False
    num_shards: int = 1
    deepseek: DeepseekShape | None = None
    deepseek_v4: DeepseekV4Shape | None = None
    # DeepSeek's block fp8 checkpoint format (kernels/fp8_blocks.py): every projection stored
    # float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block.
    fp8: bool = False

    def __post_init__(self) -> None:
        if self.vocab_size < TOKENIZER_VOCAB:
            raise ValueError(
                f"{self.name}: vocab_size {self.vocab_size} < tokenizer size {TOKENIZER_VOCAB}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: {self.num_heads} heads not divisible by {self.num_kv_heads} kv heads"
            )
        if self.num_layers % self.num_shards:
            raise ValueError(
                f"{self.name}: {self.num_layers} layers do not split into {self.num_shards} shards"
            )


_TINY_SHAPE: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32
)
SPECS: dict[str, BuiltinSpec] = {
    "tiny": BuiltinSpec(
        name="tiny", architecture="LlamaForCausalLM", model_type="llama", **_TINY_SHAPE,
        rope_theta=10000.0, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 512,
        },
        tie_word_embeddings=True, qkv_bias=False, qk_norm=False, dtype="float32", add_bos=True,
    ),
    "qwen2-tiny": BuiltinSpec(
        name="qwen2-tiny", architecture="Qwen2ForCausalLM", model_type="qwen2", **_TINY_SHAPE,
        rope_theta=1000000.0, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=False, qkv_bias=True, qk_norm=False, dtype="float32",
    ),
    # num_heads * head_dim = 512 != hidden_size 256, as in the real Qwen3 models (1024 vs
    # 2048 for Qwen3-0.6B): q_proj widens and o_proj narrows, and code that derives head_dim
    # from hidden_size / num_heads gets the wrong answer and fails loudly.
    "qwen3-tiny": BuiltinSpec(
        name="qwen3-tiny", architecture="Qwen3ForCausalLM", model_type="qwen3",
        hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8, num_kv_heads=2,
        head_dim=64, rope_theta=1000000.0, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=True, qkv_bias=False, qk_norm=True, dtype="float32",
    ),
    "qwen2-0.5b-shape": BuiltinSpec(
        name="qwen2-0.5b-shape", architecture="Qwen2ForCausalLM", model_type="qwen2",
        hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
        head_dim=64, rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=True, qkv_bias=True, qk_norm=False, dtype="bfloat16",
        vocab_size=151936, num_shards=2,
    ),
    # Llama-3.2-1B's config (1,235,814,400 parameters with the tied head, Llama-3 RoPE
    # scaling): the GPU benchmarks' larger model. Four shards of 0.5-1 GB keep the generator's
    # and the loader's peak memory at one shard, not the whole 2.5 GB.
    "llama3.2-1b-shape": BuiltinSpec(
        name="llama3.2-1b-shape", architecture="LlamaForCausalLM", model_type="llama",
        hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_scaling={
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True, qkv_bias=False, qk_norm=False, dtype="bfloat16",
        vocab_size=128256, add_bos=True, num_shards=4,
    ),
    # Every DeepSeek-V3 path at CPU-test size: a dense layer then two MoE layers, 8 experts in
    # 4 groups (2 kept) with non-zero correction biases, 3 routed + 1 shared expert per token,
    # q through q_a_proj/q_a_layernorm/q_b_proj, v_head_dim 20 != qk_nope_head_dim 24,
    # interleaved YaRN rope with mscale != mscale_all_dim (so both the cos/sin factor and the
    # softmax scale differ from 1). Latent cache: 32 + 16 values per token and layer.
    "deepseek-v3-tiny": BuiltinSpec(
        name="deepseek-v3-tiny", architecture="DeepseekV3ForCausalLM", model_type="deepseek_v3",
        hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4, num_kv_heads=4,
        head_dim=16, rope_theta=10000.0, max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
        },
        tie_word_embeddings=False, qkv_bias=False, qk_norm=False, dtype="float32",
        deepseek=DeepseekShape(
            q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=16,
            v_head_dim=20, moe_intermediate_size=64, n_routed_experts=8, n_group=4, topk_group=2,
            num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5,
        ),
    ),
}  # fmt: skip

# V3-tiny's shape plus V3.2's indexer in every layer: 16 heads (with 4, exact 0.0 ties at the
# top-k cut made HF's choice depend on torch.topk internals), a power-of-two key width (fp8
# index-K's Hadamard rotation) and index_topk 12, so every prompt past 12 tokens attends
# sparsely. V3.2's MLA rope is interleaved by definition (no rope_interleave field).
_V3 = SPECS["deepseek-v3-tiny"]
assert _V3.deepseek is not None
SPECS["deepseek-v32-tiny"] = replace(
    _V3,
    name="deepseek-v32-tiny",
    architecture="DeepseekV32ForCausalLM",
    model_type="deepseek_v32",
    deepseek=replace(_V3.deepseek, index_n_heads=16, index_head_dim=32, index_topk=12),
)

# Every DeepSeek-V4 path at CPU-test size: one layer of each attention type and then some
# (sliding only, CSA, HCA, CSA, HCA), hash routing in the first two layers (tid2eid) and
# biased top-k routing after, 4 residual streams (a 2x2 doubly stochastic mix is symmetric,
# so a transposed mix would go unnoticed), a 16-token window, HF's 4- and 128-token windows
# (a few hundred tokens cross several HCA entries), YaRN on the compress table only, and an
# indexer with 16 heads keeping 8 entries (few heads make exact 0.0 ties at the top-k cut,
# see deepseek-v32-tiny). swiglu_limit 2 clamps some expert inputs.
_SWA, _CSA, _HCA = (
    "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
)  # fmt: skip
SPECS["deepseek-v4-tiny"] = BuiltinSpec(
    name="deepseek-v4-tiny", architecture="DeepseekV4ForCausalLM", model_type="deepseek_v4",
    hidden_size=128, intermediate_size=64, num_layers=5, num_heads=4, num_kv_heads=1,
    head_dim=32, rope_theta=10000.0, max_position_embeddings=2048, rms_norm_eps=1e-6,
    tie_word_embeddings=False, qkv_bias=False, qk_norm=False, dtype="float32",
    deepseek_v4=DeepseekV4Shape(
        q_lora_rank=64, partial_rotary_factor=0.5, o_groups=2, o_lora_rank=32,
        layer_types=(_SWA, _CSA, _HCA, _CSA, _HCA),
        mlp_layer_types=("hash_moe", "hash_moe", "moe", "moe", "moe"),
        sliding_window=16, compress_rope_theta=160000.0,
        compress_yarn={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
            "beta_fast": 32, "beta_slow": 1,
        },
        index_n_heads=16, index_head_dim=32, index_topk=8, hc_mult=4, hc_sinkhorn_iters=20,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        routed_scaling_factor=1.5, swiglu_limit=2.0,
    ),
)  # fmt: skip

# DeepSeek-V3's fp8 checkpoint format at CPU-test size: V3-tiny's paths with every fused or
# stacked part on a 128-row block boundary (hidden 256, dense 512, experts 128 wide, q_lora 128,
# o_proj's input 4 x 32), so `--quantization fp8` keeps every projection fp8 but kv_b_proj.
SPECS["deepseek-v3-fp8-tiny"] = replace(
    _V3,
    name="deepseek-v3-fp8-tiny",
    hidden_size=256,
    intermediate_size=512,
    deepseek=replace(
        _V3.deepseek, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32,
        moe_intermediate_size=128,
    ),
    fp8=True,
)  # fmt: skip


def builtin_spec(name: str) -> BuiltinSpec:
    if name not in SPECS:
        raise ValueError(
            f"unknown built-in model {name!r}; valid names: {', '.join(BUILTIN_NAMES)}"
        )
    return SPECS[name]
