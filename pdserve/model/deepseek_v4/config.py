"""DeepSeek-V4's architecture (`V4Arch`), parsed and validated from an HF config.json.

HF's DeepseekV4Config folds legacy fields into the modern ones when it loads; `from_hf_config`
folds them the same way, so both read one file alike:
  * layer_types: explicit, else the legacy per-layer `compress_ratios` (0 / 4 / 128), else two
    HCA layers then CSA and HCA alternating; cut to num_hidden_layers (DeepSeek's own configs
    list the MTP layer too);
  * compress_rates: {CSA: 4, HCA: 128} unless given; legacy compress_rate_csa / _hca override;
  * mlp_layer_types: explicit, else `num_hash_layers` (default 3) hash_moe layers, then moe;
  * the rotated width: partial_rotary_factor, else legacy qk_rope_head_dim / head_dim, else
    64 / 512;
  * rope_parameters: nested {"main", "compress"} (what save_pretrained writes; each table
    names its partial_rotary_factor), or flat (or legacy rope_scaling): the flat keys (e.g.
    YaRN's) scale the compress table only, at compress_rope_theta, and a flat YaRN's
    attention_factor defaults to 1.0 (V4 does not scale cos/sin by YaRN's mscale). HF reads
    the compress table's YaRN `truncate` from the top level, where V4 has none: always true.
Settings HF would silently run differently from what the file says (norm_topk_prob false, more
than one shared expert, biases) are refused, as is anything we cannot run: each error names
the field. `V4Arch` is also the `V4Shape` the KV layout reads (kvcache/v4_layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pdserve.model.errors import ModelConfigError
from pdserve.model.rope_scaling import RopeScaling, parse_yarn

# HF's layer types, the same strings as kvcache/v4_layout.py's SWA, CSA, HCA (not imported
# from there: reading a config must not import torch; tests hold them equal).
SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
ATTENTION_TYPES = (SWA, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")
DTYPES = ("float32", "bfloat16", "float16")
_RATIO_TO_TYPE = {0: SWA, 4: CSA, 128: HCA}  # HF's reading of legacy `compress_ratios`
_DEFAULT_HASH_LAYERS = 3
_DEFAULT_ROTARY_FACTOR = 64 / 512


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table: V4 rotates the trailing `dim` channels of a head, in (even, odd)
    pairs, at `theta` (YaRN-scaled if `scaling` says so)."""

    theta: float
    dim: int
    scaling: RopeScaling


@dataclass(frozen=True)
class V4Arch:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int  # the one K=V head's width, and each query head's
    q_lora_rank: int
    o_groups: int  # grouped output projection: heads in o_groups groups ...
    o_lora_rank: int  # ... each projected to o_lora_rank, then mixed by o_b_proj
    sliding_window: int
    layer_types: tuple[str, ...]  # SWA, CSA or HCA per layer
    csa_ratio: int
    hca_ratio: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    main_rope: RopeSpec  # sliding-only layers
    compress_rope: RopeSpec  # CSA/HCA layers, their compressed entries and the indexer
    hc_mult: int  # residual streams (mHC)
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]  # HASH_MOE or MOE per layer
    num_experts: int
    top_k: int
    moe_intermediate_size: int  # each routed expert's and the one shared expert's width
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str
    mtp_layers: int  # num_nextn_predict_layers: their weights are skipped on load

    def __post_init__(self) -> None:
        for name in (
            "vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank",
            "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk",
            "hc_mult", "hc_sinkhorn_iters", "num_experts", "top_k", "moe_intermediate_size",
            "max_position_embeddings",
        ):  # fmt: skip
            _positive_int(name, getattr(self, name))
        # HF's sliding cache keeps the last `sliding_window - 1` tokens: at 1 it keeps all.
        if _positive_int("sliding_window", self.sliding_window) < 2:
            raise ModelConfigError(f"sliding_window must be >= 2, got {self.sliding_window}")
        for name in ("csa_ratio", "hca_ratio"):
            if not 1 <= _positive_int(name, getattr(self, name)) <= 4096:
                raise ModelConfigError(f"{name} must be in [1, 4096], got {getattr(self, name)}")
        if self.mtp_layers < 0:
            raise ModelConfigError(f"num_nextn_predict_layers must be >= 0, got {self.mtp_layers}")
        _check_types("layer_types", self.layer_types, ATTENTION_TYPES, self.num_layers)
        _check_types("mlp_layer_types", self.mlp_layer_types, (HASH_MOE, MOE), self.num_layers)
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ModelConfigError(
                f"num_attention_heads * head_dim = {self.num_heads * self.head_dim} does not "
                f"split into o_groups {self.o_groups}"
            )
        if self.top_k > self.num_experts:
            raise ModelConfigError(
                f"num_experts_per_tok {self.top_k} > n_routed_experts {self.num_experts}"
            )
        for which, rope in (("main", self.main_rope), ("compress", self.compress_rope)):
            if rope.dim < 2 or rope.dim % 2 or rope.dim > self.head_dim:
                raise ModelConfigError(
                    f"the {which} rope's rotated width {rope.dim} (head_dim {self.head_dim} "
                    "times partial_rotary_factor) must be even and in [2, head_dim]"
                )
            if rope.theta <= 0:
                raise ModelConfigError(f"the {which} rope's rope_theta must be > 0")
        if CSA in self.layer_types and self.compress_rope.dim > self.index_head_dim:
            raise ModelConfigError(
                f"index_head_dim {self.index_head_dim} is narrower than the compress rope's "
                f"rotated width {self.compress_rope.dim}"
            )
        if self.scoring_func not in SCORING_FUNCS:
            raise ModelConfigError(
                f"scoring_func {self.scoring_func!r} not supported; supported: {SCORING_FUNCS}"
            )
        for name in ("hc_eps", "rms_norm_eps", "swiglu_limit", "routed_scaling_factor"):
            if not getattr(self, name) > 0:
                raise ModelConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.torch_dtype not in DTYPES:
            raise ModelConfigError(f"dtype {self.torch_dtype!r} not supported; supported: {DTYPES}")

    def ratio(self, layer: int) -> int | None:
        """The layer's compression ratio; None for a sliding-window-only layer."""
        kind = self.layer_types[layer]
        return None if kind == SWA else self.csa_ratio if kind == CSA else self.hca_ratio

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], where: str = "config.json") -> V4Arch:
        try:
            return cls(**_fields(cfg))
        except ModelConfigError as e:
            raise ModelConfigError(f"{where}: {e}") from None


def _positive_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ModelConfigError(f"{name} must be an int >= 1, got {v!r}")
    return v


def _check_types(name: str, got: tuple[str, ...], allowed: tuple[str, ...], n: int) -> None:
    if len(got) != n:
        raise ModelConfigError(f"{name} has {len(got)} entries for {n} layers")
    bad = sorted({t for t in got if t not in allowed})
    if bad:
        raise ModelConfigError(f"{name} entries must be in {allowed}, got {bad}")


def _need(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ModelConfigError(f"required field {key!r} is missing")
    return cfg[key]


def _fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """V4Arch's fields from a config.json dict, legacy fields folded in as HF folds them."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act {cfg['hidden_act']!r} not supported (silu)")
    # HF builds exactly one KV head, one shared expert and normalised top-k weights, whatever
    # these say; a file that says otherwise is not the model HF (or we) would run.
    for key, want in (
        ("num_key_value_heads", 1),
        ("n_shared_experts", 1),
        ("norm_topk_prob", True),
        ("mlp_bias", False),
        ("attention_bias", False),
    ):
        if cfg.get(key) is not None and cfg[key] != want:
            raise ModelConfigError(f"{key} {cfg[key]!r} not supported; V4's is {want!r}")
    n = _positive_int("num_hidden_layers", _need(cfg, "num_hidden_layers"))
    head_dim = _positive_int("head_dim", _need(cfg, "head_dim"))
    max_pos = int(cfg.get("max_position_embeddings", 1048576))
    rates = dict(cfg.get("compress_rates") or {CSA: 4, HCA: 128})
    for key, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if cfg.get(key) is not None:
            rates[kind] = cfg[key]
    if set(rates) != {CSA, HCA}:
        raise ModelConfigError(f"compress_rates must name exactly {CSA!r} and {HCA!r}: {rates}")
    main, compress = _ropes(cfg, head_dim, max_pos)
    return dict(
        vocab_size=_need(cfg, "vocab_size"),
        hidden_size=_need(cfg, "hidden_size"),
        num_layers=n,
        num_heads=_need(cfg, "num_attention_heads"),
        head_dim=head_dim,
        q_lora_rank=_need(cfg, "q_lora_rank"),
        o_groups=_need(cfg, "o_groups"),
        o_lora_rank=_need(cfg, "o_lora_rank"),
        sliding_window=_need(cfg, "sliding_window"),
        layer_types=_layer_types(cfg, n),
        csa_ratio=rates[CSA],
        hca_ratio=rates[HCA],
        index_n_heads=_need(cfg, "index_n_heads"),
        index_head_dim=_need(cfg, "index_head_dim"),
        index_topk=_need(cfg, "index_topk"),
        main_rope=main,
        compress_rope=compress,
        hc_mult=cfg.get("hc_mult", 4),
        hc_sinkhorn_iters=cfg.get("hc_sinkhorn_iters", 20),
        hc_eps=float(cfg.get("hc_eps", 1e-6)),
        mlp_layer_types=_mlp_layer_types(cfg, n),
        num_experts=_need(cfg, "n_routed_experts"),
        top_k=_need(cfg, "num_experts_per_tok"),
        moe_intermediate_size=_need(cfg, "moe_intermediate_size"),
        scoring_func=cfg.get("scoring_func", "sqrtsoftplus"),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
    )


def _layer_types(cfg: dict[str, Any], n: int) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    legacy = cfg.get("compress_ratios")
    if types is None and legacy is not None:
        bad = sorted({r for r in legacy if r not in _RATIO_TO_TYPE})
        if bad:
            raise ModelConfigError(f"compress_ratios entries must be in (0, 4, 128), got {bad}")
        types = [_RATIO_TO_TYPE[r] for r in legacy]
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    return tuple(types[:n])


def _mlp_layer_types(cfg: dict[str, Any], n: int) -> tuple[str, ...]:
    types = cfg.get("mlp_layer_types")
    if types is None:
        hashed = cfg.get("num_hash_layers")
        hashed = _DEFAULT_HASH_LAYERS if hashed is None else int(hashed)
        types = [HASH_MOE] * min(n, hashed) + [MOE] * max(0, n - hashed)
    return tuple(types[:n])


def _ropes(cfg: dict[str, Any], head_dim: int, max_pos: int) -> tuple[RopeSpec, RopeSpec]:
    """The "main" and "compress" tables, as HF's config and rotary embedding read them."""
    factor = cfg.get("partial_rotary_factor")
    if factor is None:
        legacy = cfg.get("qk_rope_head_dim")
        factor = legacy / head_dim if legacy is not None else _DEFAULT_ROTARY_FACTOR
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = dict(rp["main"]), dict(rp["compress"])
    else:
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        main = {"rope_theta": cfg.get("rope_theta", 10000.0), "partial_rotary_factor": factor}
        compress = {
            **flat,
            "rope_theta": cfg.get("compress_rope_theta", 160000.0),
            "partial_rotary_factor": factor,
        }
        if compress.get("rope_type", compress.get("type")) == "yarn":
            compress.setdefault("attention_factor", 1.0)
    out = []
    for which, table in (("main", main), ("compress", compress)):
        kind = table.get("rope_type", table.get("type", "default"))
        allowed = ("default",) if which == "main" else ("default", "yarn")
        if kind not in allowed:
            raise ModelConfigError(f"the {which} rope's type {kind!r} not supported: {allowed}")
        if table.get("rope_theta") is None:
            raise ModelConfigError(f"the {which} rope has no rope_theta")
        # HF's YaRN reads `truncate` from the top-level rope_parameters (V4's has none there),
        # so V4's compress table always truncates its correction range.
        scaling = replace(parse_yarn(table, max_pos, f"the {which} rope"), truncate=True)
        # A nested table without it is read by HF as 1.0 or as the top-level factor,
        # depending on the order its modules are built in: refused, not guessed.
        if table.get("partial_rotary_factor") is None:
            raise ModelConfigError(f"rope_parameters[{which!r}] has no partial_rotary_factor")
        dim = int(head_dim * float(table["partial_rotary_factor"]))
        out.append(RopeSpec(float(table["rope_theta"]), dim, scaling))
    return out[0], out[1]
