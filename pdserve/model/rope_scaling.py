"""RoPE scaling: a config.json's rope fields, parsed and validated for each family.

The Llama family scales by "linear" or "llama3" (`parse_rope_scaling`); DeepSeek-V3 by YaRN
(`parse_yarn`), whose magnitude correction `yarn_mscale` also sets MLA's softmax scale
(model/deepseek_config.py) and its rope tables' attention factor (model/mla.py). Any other rope
type is refused with a ModelConfigError that names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdserve.model.errors import ModelConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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


def parse_rope_scaling(rs: dict[str, Any] | None, where: str) -> RopeScaling:
    """The Llama family's rope scaling (`rope_parameters` or `rope_scaling`), if any."""
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


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `scale` (HF's yarn_get_mscale):
    of MLA's softmax scale (model/deepseek_config.py), of the rope tables' attention factor
    (model/mla.py)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def parse_yarn(rs: dict[str, Any], max_pos: int, where: str) -> RopeScaling:
    """DeepSeek-V3's rope scaling: none, or YaRN with its factor and original context."""
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
