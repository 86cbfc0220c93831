"""Quantised checkpoint weights: each paired with its scale, checked, and dequantised on load.

The formats (model/quant_config.py reads which one a config.json names):
  * fp8 blocks: a float8_e4m3fn weight [M, N] with one scale per (b0 x b1) block, b =
    weight_block_size: the scale tensor is [ceil(M / b0), ceil(N / b1)] (the last blocks cut
    short). It holds float32 values (`X.weight_scale_inv`: DeepSeek-V3, and what transformers
    writes) or E8M0 exponents e meaning 2^(e - 127) (`X.scale`: DeepSeek-V4; safetensors
    F8_E8M0, or U8 bytes under scale_fmt "ue8m0").
  * fp4 e2m1 (DeepSeek-V4's routed experts, expert_dtype "fp4"): a weight [M, N] stored as
    int8 (or safetensors F4) [M, N / 2]: value 2j of a row in the low nibble of byte j, value
    2j + 1 in the high one; a nibble is a sign bit (8) over a magnitude code 0..7 meaning
    0, 0.5, 1, 1.5, 2, 3, 4, 6. One E8M0 scale per 32 consecutive values of a row: [M, N / 32].
The weight is value * scale in float32, then cast to the model's dtype: the same IEEE
products and the same cast as transformers' `Fp8Dequantize._dequantize_one`
(integrations/finegrained_fp8.py, loading with FineGrainedFP8Config(dequantize=True)), so the
weights are bit for bit the ones it loads (its block comes from the scale grid, which is ours
wherever every dim is a multiple of its block or within one, as in DeepSeek's checkpoints).

Every scale is checked against its weight before a byte is read, each refusal a
ModelConfigError naming the tensor: a scale without its weight, a quantised weight without its
scale, a scale of the wrong shape or dtype, fp4 data where the config says the experts are
fp8. E8M0's one NaN code (255) is refused when the scale is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from pdserve.model.errors import ModelConfigError
from pdserve.model.quant_config import ExpertDtype, QuantConfig, ScaleFormat
from pdserve.model.safetensors_file import StoredTensor


class WeightFormat(Enum):
    FP8 = "fp8"  # float8_e4m3fn, a scale per weight_block_size block
    FP4 = "fp4"  # e2m1 packed two a byte, a scale per FP4_BLOCK values of a row


FP4_BLOCK = 32  # DeepSeek's fp4_block_size: the values one E8M0 scale covers, along a row
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; 8..15 are their negatives
FP4_VALUES = FP4_MAGNITUDES + tuple(-v for v in FP4_MAGNITUDES)
FP4_STORAGE = (torch.int8, torch.float4_e2m1fn_x2)
E8M0_STORAGE = (torch.float8_e8m0fnu, torch.uint8)
E8M0_NAN = 255
FP8_STORAGE = (torch.float8_e4m3fn, torch.float8_e5m2)  # e5m2 is refused (fmt is e4m3), not ignored
# A weight's scale is named after it: DeepSeek-V3's (and transformers') suffix, or DeepSeek-V4's.
SCALE_INV, SCALE = ".weight_scale_inv", ".scale"


@dataclass(frozen=True)
class BlockScale:
    """The scale of one quantised weight: one value per (rows x cols) block of it."""

    tensor: StoredTensor
    block: tuple[int, int]
    fmt: WeightFormat = WeightFormat.FP8

    def weight_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        """The dequantised weight's shape, from its stored one (fp4: two values a byte)."""
        if self.fmt is WeightFormat.FP4:
            return (*stored[:-1], 2 * stored[-1])
        return stored


def take_scales(
    stored: dict[str, StoredTensor], quant: QuantConfig | None, where: str
) -> dict[str, BlockScale]:
    """Take every scale out of `stored`: {its weight's name: its BlockScale}, each checked
    against its weight and `quant`; a quantised weight left without one is refused."""
    pairs = {s: w for s, t in stored.items() if (w := _weight_of(s, t, stored)) is not None}
    out: dict[str, BlockScale] = {}
    named: dict[str, str] = {}  # weight -> its scale's name
    for name, weight in sorted(pairs.items()):
        if quant is None:
            raise ModelConfigError(
                f"{where}: {name} and {len(pairs) - 1} more scales, but config.json has no fp8 "
                "quantization_config with a weight_block_size"
            )
        if weight in named:
            raise ModelConfigError(
                f"{where}: weight {weight} has two scales, {named[weight]} and {name}"
            )
        named[weight] = name
        out[weight] = _checked(name, stored.pop(name), weight, stored.get(weight), quant, where)
    fp4 = FP4_STORAGE if quant and quant.expert_dtype is ExpertDtype.FP4 else FP4_STORAGE[1:]
    unscaled = sorted(n for n, t in stored.items() if t.dtype in FP8_STORAGE + fp4 and n not in out)
    if unscaled:
        more = f" and {len(unscaled) - 5} more" if len(unscaled) > 5 else ""
        listed = ", ".join(unscaled[:5]) + more
        raise ModelConfigError(
            f"{where}: quantised weights without a weight_scale_inv: {listed} (each needs its "
            "X.weight_scale_inv, or DeepSeek-V4's X.scale)"
        )
    return out


def _weight_of(name: str, t: StoredTensor, stored: dict[str, StoredTensor]) -> str | None:
    """The weight that `name` is the scale of, or None: not a scale. `X.scale` is also a
    parameter's own name (V4's `attn_hc.scale` in transformers' naming), so it counts as a
    scale only beside an `X.weight` or stored as E8M0."""
    if name.endswith(SCALE_INV):
        return name.removesuffix("_scale_inv")
    if name.endswith(SCALE):
        weight = name.removesuffix("scale") + "weight"
        if weight in stored or t.dtype in E8M0_STORAGE:
            return weight
    return None


def _checked(
    name: str,
    scale: StoredTensor,
    weight: str,
    w: StoredTensor | None,
    quant: QuantConfig,
    where: str,
) -> BlockScale:
    if w is None:
        raise ModelConfigError(f"{where}: scale {name} has no weight {weight} in the checkpoint")
    if len(w.shape) != 2:
        raise ModelConfigError(f"{where}: scale {name}'s weight {weight} is {w.shape}, not 2-D")
    if w.dtype == torch.float8_e4m3fn:
        spec = BlockScale(scale, quant.block, WeightFormat.FP8)
        e8m0 = E8M0_STORAGE if quant.scale_fmt is ScaleFormat.UE8M0 else ()
        allowed: tuple[torch.dtype, ...] = (torch.float32, *e8m0)
    elif w.dtype in FP4_STORAGE:
        if quant.expert_dtype is not ExpertDtype.FP4:
            raise ModelConfigError(
                f"{where}: {weight} is {w.dtype} with a scale (fp4 data), but config.json's "
                f"expert_dtype is {quant.expert_dtype.value!r}"
            )
        spec, allowed = BlockScale(scale, (1, FP4_BLOCK), WeightFormat.FP4), E8M0_STORAGE
    else:
        raise ModelConfigError(
            f"{where}: scale {name} is for {weight}, a {w.dtype} tensor; only float8_e4m3fn "
            "(fp8) and int8-packed e2m1 (fp4) weights are scaled"
        )
    m, n = spec.weight_shape(w.shape)
    b0, b1 = spec.block
    if spec.fmt is WeightFormat.FP4 and n % FP4_BLOCK:
        raise ModelConfigError(
            f"{where}: fp4 weight {weight} {w.shape} has rows of {n} values, not whole blocks "
            f"of {FP4_BLOCK}"
        )
    want = (-(-m // b0), -(-n // b1))
    if scale.shape != want or scale.dtype not in allowed:
        raise ModelConfigError(
            f"{where}: scale {name} is {scale.dtype} {scale.shape}; weight {weight} "
            f"({spec.fmt.value}, [{m}, {n}] in blocks of {spec.block}) needs "
            f"{' or '.join(map(str, allowed))} {want}"
        )
    return spec


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, spec: BlockScale, name: str
) -> torch.Tensor:
    """The weight `name` [M, N] in float32, from its stored data and scale (as `spec` says)."""
    values = fp4_values(weight) if spec.fmt is WeightFormat.FP4 else weight.float()  # [M, N]
    s = scale if scale.dtype == torch.float32 else e8m0_values(scale, name)  # [M / b0, N / b1]
    b0, b1 = spec.block
    m, n = values.shape
    return values * s.repeat_interleave(b0, 0)[:m].repeat_interleave(b1, 1)[:, :n]


def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """e2m1 values two a byte [..., N / 2] (int8 or float4_e2m1fn_x2) -> float32 [..., N]."""
    codes = packed.view(torch.uint8).long()
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=packed.device)
    return torch.stack((table[codes & 15], table[codes >> 4]), dim=-1).flatten(-2)


def e8m0_values(scale: torch.Tensor, name: str) -> torch.Tensor:
    """E8M0 exponents (float8_e8m0fnu or uint8) -> float32 2^(e - 127); 255 (NaN) refused."""
    e = scale.view(torch.uint8)
    if bool((e == E8M0_NAN).any()):
        raise ModelConfigError(f"the scale of {name} holds E8M0 byte {E8M0_NAN}, which is NaN")
    return e.view(torch.float8_e8m0fnu).float()
