"""DeepSeek-V3's own architecture facts, parsed and validated from its config.json.

V3 adds multi-head latent attention (`MLAArch`) and routed experts (`MoEArch`) to the facts
every model has (model/config.py ModelArch); V3.2 adds its lightning indexer (`DSAArch`).
`deepseek_v3_fields` reads them all and returns ModelArch's fields, from which
ModelArch.from_hf_config builds the ModelArch (reading the fp8 quantization_config there, as
for every family). Router settings HF ignores but a checkpoint names are checked, not assumed;
anything we cannot run faithfully is refused with a ModelConfigError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.model.errors import ModelConfigError
from pdserve.model.rope_scaling import parse_yarn, yarn_mscale


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


def deepseek_v3_fields(cfg: dict[str, Any], where: str, arch: str) -> dict[str, Any]:
    """ModelArch's fields for DeepSeek-V3 or V3.2 (`arch`), all but `quant`."""

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
    scaling = parse_yarn(rope, max_pos, where)
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
    return dict(
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
