"""ModelArch: the architecture facts pdserve needs, parsed and validated from an HF config.json.

One frozen dataclass for the Llama family (Llama, Mistral, Qwen2, Qwen3), whose variants differ
only in flags (qkv bias, q/k norm, tied embeddings, RoPE scaling), and for DeepSeek-V3, which
adds its latent attention (`mla`) and its routed experts (`moe`), and V3.2 (its indexer, `dsa`);
DeepSeek-V4's own fields are one `V4Arch` (`v4`, model/deepseek_v4/config.py).
Anything we cannot run faithfully is refused here with an error that names the field, never
guessed at later. DeepSeek's own fields are read in model/deepseek_config.py, the rope fields
of every family in model/rope_scaling.py, a quantised checkpoint's quantization_config in
model/quant_config.py; a GGUF file's metadata becomes such a config in model/gguf_file.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.model.deepseek_config import DSAArch, MLAArch, MoEArch, deepseek_v3_fields
from pdserve.model.deepseek_v4.config import V4Arch
from pdserve.model.errors import ModelConfigError
from pdserve.model.gguf_file import find_gguf, open_gguf
from pdserve.model.quant_config import QuantConfig
from pdserve.model.rope_scaling import RopeScaling, parse_rope_scaling

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v3",  # V3 plus the indexer (ModelArch.dsa)
    "DeepseekV4ForCausalLM": "deepseek_v4",  # its own fields: ModelArch.v4
}
# Architectures people will try, and why they cannot run yet (named in the refusal).
NOT_YET = {
    "DeepseekV2ForCausalLM": "DeepSeek-V2 (softmax routing) is not supported; V3 is",
}


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
    v4: V4Arch | None = None  # DeepSeek-V4: everything about it (the fields above mirror it)
    mtp_layers: int = 0  # multi-token prediction layers after the last: their weights are skipped
    # quantization_config of a block-quantised checkpoint (dequantised on load), else None.
    quant: QuantConfig | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelConfigError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )

    def for_rank(self, tp_size: int, rank: int) -> ModelArch:
        """The attention one of `tp_size` tensor-parallel ranks runs, for its attention backend
        and KV pool: its query heads (num_heads / tp_size) and the KV heads they read
        (num_kv_heads / tp_size, or the one they share where there are fewer KV heads than
        ranks: replicated); every other field is the whole model's. TP 1: this arch itself.
        Every rank's counts are the same; `rank` is checked, not used.

        DeepSeek-V3 / V3.2 at `tp_size` ranks are expert-parallel (model/moe.py): each rank
        holds n_routed_experts / tp_size of the routed experts and everything else whole
        (latent attention, V3.2's indexer, the dense MLPs, the shared experts), so its arch is
        this one.

        Raises ModelConfigError, naming the field, for a model that does not split over
        `tp_size` ranks: DeepSeek-V4 (TP 1 only), routed experts, heads or an MLP width not
        divisible by it, KV heads that neither split nor replicate."""
        if tp_size < 1 or not 0 <= rank < tp_size:
            raise ValueError(f"rank {rank} is not one of {tp_size} tensor-parallel ranks")
        if tp_size == 1:
            return self
        if self.v4 is not None:
            raise ModelConfigError(
                f"{self.architecture} runs at tensor parallelism 1 only, not {tp_size}"
            )
        if self.moe is not None:  # expert parallel: the routed experts split, the rest whole
            if self.moe.num_experts % tp_size:
                raise ModelConfigError(
                    f"n_routed_experts {self.moe.num_experts} does not split over {tp_size} "
                    "expert-parallel ranks"
                )
            return self
        if self.mla is not None:
            raise ModelConfigError(f"{self.architecture} has latent attention but no experts")
        for name, value in (
            ("num_attention_heads", self.num_heads),
            ("intermediate_size", self.intermediate_size),
        ):
            if value % tp_size:
                raise ModelConfigError(
                    f"{name} {value} does not split over {tp_size} tensor-parallel ranks"
                )
        kv = self.num_kv_heads
        if kv % tp_size and tp_size % kv:
            raise ModelConfigError(
                f"num_key_value_heads {kv} neither splits over {tp_size} tensor-parallel ranks "
                "nor divides them (to be replicated)"
            )
        return replace(
            self, num_heads=self.num_heads // tp_size, num_kv_heads=max(1, kv // tp_size)
        )

    @classmethod
    def for_v4(cls, v4: V4Arch, quant: QuantConfig | None = None) -> ModelArch:
        """DeepSeek-V4's ModelArch: the common fields read off its V4Arch."""
        return cls(
            architecture="DeepseekV4ForCausalLM",
            family="deepseek_v4",
            vocab_size=v4.vocab_size,
            hidden_size=v4.hidden_size,
            intermediate_size=v4.moe_intermediate_size,
            num_layers=v4.num_layers,
            num_heads=v4.num_heads,
            num_kv_heads=1,  # one K=V head, shared by every query head
            head_dim=v4.head_dim,
            rms_norm_eps=v4.rms_norm_eps,
            rope_theta=v4.main_rope.theta,
            rope_scaling=v4.main_rope.scaling,
            max_position_embeddings=v4.max_position_embeddings,
            tie_word_embeddings=v4.tie_word_embeddings,
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
            qk_norm=False,
            torch_dtype=v4.torch_dtype,
            mtp_layers=v4.mtp_layers,
            v4=v4,
            quant=quant,
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelArch:
        """From an HF directory's config.json, or a GGUF file's metadata (a .gguf, or a
        directory holding one and no config.json)."""
        gguf = find_gguf(Path(path))
        if gguf is not None:
            return cls.from_hf_config(open_gguf(gguf).hf_config(), where=str(gguf))
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
        quant = QuantConfig.from_hf_config(cfg, where)
        if family == "deepseek_v3":
            return cls(**deepseek_v3_fields(cfg, where, arch), quant=quant)
        if family == "deepseek_v4":
            return cls.for_v4(V4Arch.from_hf_config(cfg, where), quant)

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
            rope_scaling=parse_rope_scaling(rope_scaling, where),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and no o_proj bias; the others follow attention_bias.
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=family != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            quant=quant,
        )
