"""ModelArch: the architecture facts pdserve needs, parsed and validated from an HF config.json.

One frozen dataclass for the Llama family (Llama, Mistral, Qwen2, Qwen3), whose variants differ
only in flags (qkv bias, q/k norm, tied embeddings, RoPE scaling), and for DeepSeek-V3, which
adds its latent attention (`mla`) and its routed experts (`moe`), and V3.2 (its indexer, `dsa`).
Anything we cannot run faithfully is refused here with an error that names the field, never
guessed at later.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v3",  # V3 plus the indexer (ModelArch.dsa)
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Architectures people will try, and why they cannot run yet (named in the refusal).
NOT_YET = {
    "DeepseekV2ForCausalLM": "DeepSeek-V2 (softmax routing) is not supported; V3 is",
    "DeepseekV4ForCausalLM": "DeepSeek-V4 is not supported",
}


class ModelConfigError(ValueError):
    """The model directory is not one pdserve can serve; the message says what is wrong."""


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (DeepSeek), HF's names and defaults; `attention_factor` None = derived from mscale.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str
    # DeepSeek-V3 only: latent attention and routed experts; V3.2 also its indexer.
    mla: MLAArch | None = None
    moe: MoEArch | None = None
    dsa: DSAArch | None = None
    mtp_layers: int = 0  # multi-token prediction layers after the last: their weights are skipped
    # quantization_config of an fp8 block-quantised checkpoint: (rows, cols) of a scale's block.
    fp8_block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelConfigError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )

    @classmethod
    def from_dir(cls, path: Path) -> ModelArch:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ModelConfigError(f"{path} is not a model directory: config.json is missing")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{cfg_path} is not valid JSON: {e}") from e
        return cls.from_hf_config(cfg, where=str(cfg_path))

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], where: str = "config.json") -> ModelArch:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            why = [f"{a}: {NOT_YET[a]}" for a in archs if a in NOT_YET]
            if why:
                raise ModelConfigError(f"{where}: architecture not supported: {'; '.join(why)}")
            raise ModelConfigError(
                f"{where}: architectures {archs} not supported; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        if family == "deepseek_v3":
            return _deepseek_v3(cfg, where, arch)

        def need(key: str) -> Any:
            if key not in cfg:
                raise ModelConfigError(f"{where}: required field {key!r} is missing")
            return cfg[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        if family == "qwen2" and cfg.get("use_sliding_window"):
            raise ModelConfigError(f"{where}: use_sliding_window=true is not supported")
        window = cfg.get("sliding_window") if family == "mistral" else None
        if window is not None:
            # Attention within the window equals full attention while the context fits it.
            max_pos = min(max_pos, int(window))
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"{where}: hidden_act {cfg.get('hidden_act')!r} not supported")
        # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_scaling`.
        rope = cfg.get("rope_parameters") or {}
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_scaling = rope if rope else cfg.get("rope_scaling")
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=_parse_rope_scaling(rope_scaling, where),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and no o_proj bias; the others follow attention_bias.
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=family != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            fp8_block=_fp8_block(cfg, where),
        )


def _parse_rope_scaling(rs: dict[str, Any] | None, where: str) -> RopeScaling:
    if not rs:
        return RopeScaling()
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{where}: rope_scaling type {rope_type!r} not supported; "
            f"supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeScaling(
        rope_type=rope_type,
        factor=float(rs.get("factor", 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )


def _fp8_block(cfg: dict[str, Any], where: str) -> tuple[int, int] | None:
    """DeepSeek's fp8 checkpoints: `weight_block_size` [128, 128], one float32
    `weight_scale_inv` per block of each fp8 weight. Other quantisations are refused."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    block = q.get("weight_block_size") if isinstance(q, dict) else None
    if method != "fp8" or not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ModelConfigError(
            f"{where}: quantization_config {q!r} not supported; only block-quantised fp8 "
            "(quant_method 'fp8' with a weight_block_size [rows, cols]) is, dequantised on load"
        )
    return block[0], block[1]


# ---------------------------------------------------------------- DeepSeek-V3


@dataclass(frozen=True)
class MLAArch:
    """Multi-head latent attention: what each token caches is `kv_lora_rank` normed latent
    values plus `qk_rope_head_dim` rotated key values, shared by every head."""

    q_lora_rank: int | None  # None: one q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotate (even, odd) pairs, output halves (HF's rope_interleave)
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2
    attention_bias: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Per-token cached width: the latent, then the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEArch:
    """DeepSeek-V3's experts: layers from `first_k_dense_replace` on route each token to
    `top_k` of `num_experts` (sigmoid scores plus a correction bias, within the best `topk_group`
    of `n_group` groups), and add `n_shared_experts` always-on experts."""

    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int

    def __post_init__(self) -> None:
        per_group = self.num_experts // max(self.n_group, 1)
        if self.n_group < 1 or self.num_experts % self.n_group or per_group < 2:
            raise ModelConfigError(
                f"n_routed_experts {self.num_experts} must split into n_group {self.n_group} "
                "groups of at least 2 experts"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ModelConfigError(f"topk_group {self.topk_group} not in [1, {self.n_group}]")
        if not 1 <= self.top_k <= self.topk_group * per_group:
            raise ModelConfigError(
                f"num_experts_per_tok {self.top_k} not in [1, {self.topk_group * per_group}] "
                f"(topk_group {self.topk_group} groups of {per_group} experts)"
            )

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


@dataclass(frozen=True)
class DSAArch:
    """DeepSeek-V3.2's sparse attention: every layer's indexer (model/dsa_indexer.py) caches
    an `index_head_dim` key per token and picks each token's `index_topk` keys."""

    index_n_heads: int
    index_head_dim: int
    index_topk: int

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ModelConfigError(f"{name} must be >= 1, got {value}")


def _deepseek_v3(cfg: dict[str, Any], where: str, arch: str) -> ModelArch:
    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ModelConfigError(f"{where}: required field {key!r} is missing")
        return cfg[key]

    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{where}: hidden_act {cfg.get('hidden_act')!r} not supported")
    # Real checkpoints name their router; HF ignores these fields and always runs V3's.
    for key, want in (
        ("scoring_func", "sigmoid"),
        ("topk_method", "noaux_tc"),
        ("moe_layer_freq", 1),
    ):
        if cfg.get(key, want) != want:
            raise ModelConfigError(f"{where}: {key} {cfg[key]!r} not supported; V3's is {want!r}")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    scaling = _deepseek_rope(rope, max_pos, where)
    heads = int(need("num_attention_heads"))
    nope, rot, v = (int(need(k)) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    scale = (nope + rot) ** -0.5
    if scaling.rope_type == "yarn" and scaling.mscale_all_dim:
        m = yarn_mscale(scaling.factor, scaling.mscale_all_dim)
        scale = scale * m * m
    if "q_lora_rank" not in cfg:  # HF's default (1536) would be a guess about this checkpoint
        raise ModelConfigError(f"{where}: required field 'q_lora_rank' is missing (null: q_proj)")
    q_lora = cfg["q_lora_rank"]
    dsa = _dsa(cfg, where, need) if arch == "DeepseekV32ForCausalLM" else None
    mla = MLAArch(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(need("kv_lora_rank")),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rot,
        v_head_dim=v,
        # V3.2 (HF) has no such field: its MLA rotates pairs, always.
        rope_interleave=dsa is not None or bool(cfg.get("rope_interleave", True)),
        softmax_scale=scale,
        attention_bias=bool(cfg.get("attention_bias", False)),
    )
    try:
        moe = MoEArch(
            num_experts=int(need("n_routed_experts")),
            top_k=int(need("num_experts_per_tok")),
            n_group=int(need("n_group")),
            topk_group=int(need("topk_group")),
            norm_topk_prob=bool(need("norm_topk_prob")),
            routed_scaling_factor=float(need("routed_scaling_factor")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            n_shared_experts=int(need("n_shared_experts")),
            first_k_dense_replace=int(need("first_k_dense_replace")),
        )
    except ModelConfigError as e:
        raise ModelConfigError(f"{where}: {e}") from None
    return ModelArch(
        architecture=arch,
        family="deepseek_v3",
        vocab_size=int(need("vocab_size")),
        hidden_size=int(need("hidden_size")),
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=heads,  # expanded MLA: every head has its own key and value
        head_dim=nope + rot,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=False,
        o_bias=mla.attention_bias,
        mlp_bias=False,
        qk_norm=False,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        mla=mla,
        moe=moe,
        dsa=dsa,
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        fp8_block=_fp8_block(cfg, where),
    )


def _dsa(cfg: dict[str, Any], where: str, need: Any) -> DSAArch:
    """V3.2's indexer fields; what HF's V3.2 would read differently from us is refused."""
    if cfg.get("q_lora_rank") is None:
        raise ModelConfigError(f"{where}: DeepSeek-V3.2 needs q_lora_rank (its indexer's query)")
    layers, dense = int(need("num_hidden_layers")), int(need("first_k_dense_replace"))
    kinds = cfg.get("mlp_layer_types")
    if kinds is not None and list(kinds) != ["dense"] * dense + ["sparse"] * (layers - dense):
        raise ModelConfigError(
            f"{where}: mlp_layer_types {kinds} is not first_k_dense_replace={dense} dense "
            "layers then sparse ones"
        )
    try:
        return DSAArch(*(int(need(k)) for k in ("index_n_heads", "index_head_dim", "index_topk")))
    except ModelConfigError as e:
        raise ModelConfigError(f"{where}: {e}") from None


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `scale` (HF's yarn_get_mscale):
    of the softmax scale here, of the rope tables' attention factor in model/mla.py."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _deepseek_rope(rs: dict[str, Any], max_pos: int, where: str) -> RopeScaling:
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type == "default":
        return RopeScaling()
    if rope_type != "yarn":
        raise ModelConfigError(
            f"{where}: rope type {rope_type!r} not supported for DeepSeek-V3; "
            "supported: ['default', 'yarn']"
        )
    if rs.get("factor") is None or rs.get("original_max_position_embeddings") is None:
        raise ModelConfigError(
            f"{where}: yarn rope needs 'factor' and 'original_max_position_embeddings'"
        )
    af = rs.get("attention_factor")
    return RopeScaling(
        rope_type="yarn",
        factor=float(rs["factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        beta_fast=float(rs.get("beta_fast") or 32),
        beta_slow=float(rs.get("beta_slow") or 1),
        mscale=float(rs.get("mscale") or 0.0),
        mscale_all_dim=float(rs.get("mscale_all_dim") or 0.0),
        attention_factor=None if af is None else float(af),
        truncate=bool(rs.get("truncate", True)),
    )
