"""QuantConfig: how a block-quantised DeepSeek checkpoint stores its weights, read from
config.json's `quantization_config` (and V4's top-level `expert_dtype`).

Two layouts ship, both dequantised on load (model/quantized.py says how):
  * DeepSeek-V3 / V3.2: {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
    "activation_scheme": "dynamic"}: fp8 weights with a float32 `weight_scale_inv` per block
    (V3.1 adds "scale_fmt": "ue8m0": the same float32 scales, rounded to powers of two);
  * DeepSeek-V4-Flash: the same plus "scale_fmt": "ue8m0", scales stored as E8M0 bytes
    (`X.scale`), and "expert_dtype": "fp4" (top level in DeepSeek's file; transformers moves
    it into quantization_config): the routed experts in e2m1, one E8M0 scale per 32 values.
Anything else (another method, fmt, scale format or expert dtype) is refused here, naming the
field: a checkpoint we cannot dequantise exactly is never guessed at. No torch here: reading
a config must not import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from pdserve.model.errors import ModelConfigError


class ScaleFormat(Enum):
    """How a scale is stored: float32 values, or E8M0 exponents (float32 powers of two too)."""

    FLOAT = "float"
    UE8M0 = "ue8m0"


class ExpertDtype(Enum):
    """The routed experts' weights: fp8 blocks like the rest, or fp4 (e2m1, 32-value blocks)."""

    FP8 = "fp8"
    FP4 = "fp4"


@dataclass(frozen=True)
class QuantConfig:
    block: tuple[int, int]  # weight_block_size: the (rows, cols) one fp8 scale covers
    scale_fmt: ScaleFormat = ScaleFormat.FLOAT
    expert_dtype: ExpertDtype = ExpertDtype.FP8

    def __post_init__(self) -> None:
        if len(self.block) != 2 or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in self.block
        ):
            raise ModelConfigError(f"weight_block_size must be two ints > 0, got {self.block!r}")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], where: str) -> QuantConfig | None:
        """The checkpoint's quantisation, or None for an unquantised one."""
        q = cfg.get("quantization_config")
        if not q:
            return None
        block = q.get("weight_block_size") if isinstance(q, dict) else None
        if (
            not isinstance(q, dict)
            or q.get("quant_method") != "fp8"
            or not (isinstance(block, list) and len(block) == 2)
        ):
            raise ModelConfigError(
                f"{where}: quantization_config {q!r} not supported; only block-quantised fp8 "
                "(quant_method 'fp8' with a weight_block_size [rows, cols]) is, dequantised "
                "on load"
            )
        if q.get("fmt", "e4m3") != "e4m3":
            raise ModelConfigError(
                f"{where}: quantization_config fmt {q['fmt']!r} not supported; DeepSeek's fp8 "
                "weights are 'e4m3'"
            )
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise ModelConfigError(
                f"{where}: quantization_config activation_scheme {q['activation_scheme']!r} "
                "not supported; only 'dynamic' (no activation scales in the checkpoint) is"
            )
        top, inner = cfg.get("expert_dtype"), q.get("expert_dtype")
        if top is not None and inner is not None and top != inner:
            raise ModelConfigError(
                f"{where}: expert_dtype {top!r} and quantization_config's {inner!r} disagree"
            )
        scale_fmt, expert = q.get("scale_fmt") or "float", inner or top or "fp8"
        fields = (("scale_fmt", scale_fmt, ScaleFormat), ("expert_dtype", expert, ExpertDtype))
        for field, value, kind in fields:
            allowed = [m.value for m in kind]
            if value not in allowed:
                raise ModelConfigError(
                    f"{where}: quantization_config {field} {value!r} not supported; supported: "
                    f"{allowed}"
                )
        try:
            return cls((block[0], block[1]), ScaleFormat(scale_fmt), ExpertDtype(expert))
        except ModelConfigError as e:
            raise ModelConfigError(f"{where}: quantization_config {e}") from None
