"""Which of a block-quantised checkpoint's fp8 weights the loader keeps fp8 (`--quantization`),
and where their scales go.

`--quantization auto` (the default) keeps fp8 every fp8 weight of a DeepSeek-V3 / V3.2
checkpoint that a kernel can multiply as stored, on a GPU with fp8 tensor cores (sm_89 and
later: Triton's e4m3 dot); `fp8` insists: refused, naming why, where nothing can be kept or on a
GPU without them, and on a CPU it runs the torch reference (kernels/fp8_blocks.py: the tests'
oracle, not a fast path); `none` dequantises everything on load (model/quantized.py). A weight
stays fp8 when:
  * its scales are float32 (or E8M0 powers of two, widened to float32) over 128 x 128 blocks,
    the block DeepSeek's activation groups and kernels/fp8_blocks.py's product assume;
  * its parameter is an nn.Linear's weight (swapped for model/fp8_linear.py's Fp8Linear) or one
    the module lists in FP8_PARAMS (the stacked routed experts, model/moe.py), and the model
    does not list it in DEQUANTISED_PARAMS (kv_b_proj: the absorbed MLA decode folds its
    halves into the query and the output, model/mla.py, as DeepSeek's own inference
    dequantises it) or FLOAT32_PARAMS (read in float32 as they are);
  * a module's FP8_PARAMS stay fp8 together or not at all (the stacked experts multiply both
    of their weights one way);
  * every checkpoint tensor it is made of starts on a block boundary of its rows (gate and up
    fused, experts stacked: the parts' scales then stack into the parameter's scales). A
    part that ends inside a block (a tiny model's 64-row gate) leaves the parameter
    dequantised: its scales would not tile.
The loader decides on the meta model, so the kept parameters are allocated fp8 from the
start: a load never holds the dequantised copy of what it keeps.
Each kept parameter P gets a float32 parameter `P_scale_inv` (Fp8Linear's is its
`weight_scale_inv`) shaped like its blocks; the scales fill it through the same placements as
the weights, their rows divided by the block (`scale_region`). A "scale_fmt": "ue8m0"
checkpoint (V3.1, V3.2) also flags what it keeps to round its activation scales up to powers
of two, as DeepSeek's inference does for it: Fp8Linear's `pow2_scales`, and `fp8_pow2_scales`
on a module with FP8_PARAMS (model/moe.py's Experts).

DeepSeek-V4 keeps its dequantised path (its fp4 experts and E8M0 layout are another kernel).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.config import QUANTIZATIONS
from pdserve.kernels.fp8_blocks import BLOCK, FP8_DTYPE
from pdserve.model.config import ModelArch, ModelConfigError
from pdserve.model.fp8_linear import Fp8Linear, scale_shape
from pdserve.model.quantized import BlockScale, WeightFormat
from pdserve.model.weight_map import Index, IndexSlice, Placement, Region, Slice, Whole

SCALE_SUFFIX = "_scale_inv"  # a kept parameter's scales: P -> P_scale_inv
FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the e4m3 dot
POW2_FLAG = "fp8_pow2_scales"  # a module with FP8_PARAMS: its activation scales powers of two


def keeps_fp8(choice: str, arch: ModelArch, device: torch.device, where: str) -> bool:
    """Whether this load keeps fp8 weights fp8 (module docstring); `fp8` where nothing can be
    kept is refused naming why."""
    if choice not in QUANTIZATIONS:
        raise ModelConfigError(f"--quantization must be one of {QUANTIZATIONS}, got {choice!r}")
    if choice == "none":
        return False
    why = _cannot_keep(arch) or _no_fp8_kernel(device, choice)
    if why and choice == "fp8":
        raise ModelConfigError(f"{where}: --quantization fp8: {why}; use --quantization none")
    return why is None


def _cannot_keep(arch: ModelArch) -> str | None:
    if arch.quant is None:
        return "the checkpoint is not block-quantised (no fp8 quantization_config)"
    if arch.family != "deepseek_v3" or arch.v4 is not None:
        return f"fp8 weights are kept fp8 for DeepSeek-V3 and V3.2 only, not {arch.architecture}"
    if arch.quant.block != (BLOCK, BLOCK):
        return f"weight_block_size {list(arch.quant.block)} is not [{BLOCK}, {BLOCK}]"
    return None


def _no_fp8_kernel(device: torch.device, choice: str) -> str | None:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < FP8_CAPABILITY:
            return f"this GPU (sm_{major}{minor}) has no fp8 tensor cores (sm_89 and later)"
        return None
    # A CPU multiplies through the torch reference: kept only when asked for.
    return None if choice == "fp8" else f"no fp8 kernel on {device.type}"


@dataclass(frozen=True)
class Fp8Plan:
    """The parameters kept fp8, and where each checkpoint scale goes: {source: placement}."""

    kept: frozenset[str]
    scales: dict[str, Placement]


def plan_fp8(
    model: nn.Module,
    placements: list[Placement],
    scales: dict[str, BlockScale],
    choice: str,
    where: str,
) -> Fp8Plan:
    """The parameters of `model` (on the meta device) whose every placement is an fp8 tensor
    that can stay fp8; `fp8` with none to keep is refused."""
    by_target: dict[str, list[Placement]] = defaultdict(list)
    for p in placements:
        by_target[p.target].append(p)
    skip = getattr(model, "DEQUANTISED_PARAMS", ()) + getattr(model, "FLOAT32_PARAMS", ())
    regions: dict[str, list[Region]] = {}
    for target, parts in by_target.items():
        if target.endswith(skip) or not _multipliable(model, target):
            continue
        if not all(p.source in scales and scales[p.source].fmt is WeightFormat.FP8 for p in parts):
            continue
        found = [scale_region(p.region) for p in parts]
        if all(r is not None for r in found):
            regions[target] = [r for r in found if r is not None]
    for owner, names in _fp8_groups(model).items():  # all of a module's FP8_PARAMS, or none
        if not all(f"{owner}.{n}" in regions for n in names):
            for n in names:
                regions.pop(f"{owner}.{n}", None)
    if not regions and choice == "fp8":
        raise ModelConfigError(
            f"{where}: --quantization fp8: no fp8 weight can stay fp8 (each needs 128 x 128 "
            "blocks, parts on block boundaries); use --quantization none"
        )
    out = {
        p.source: Placement(p.source, p.target + SCALE_SUFFIX, r)
        for target, found in regions.items()
        for p, r in zip(by_target[target], found, strict=True)
    }
    return Fp8Plan(frozenset(regions), out)


def _fp8_groups(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every module that lists FP8_PARAMS: {its name: those parameters}."""
    return {
        name: tuple(m.FP8_PARAMS)
        for name, m in model.named_modules()
        if getattr(m, "FP8_PARAMS", ())
    }


def _multipliable(model: nn.Module, target: str) -> bool:
    owner, _, attr = target.rpartition(".")
    module = model.get_submodule(owner)
    if type(module) is nn.Linear:
        return attr == "weight" and module.bias is None
    return attr in getattr(module, "FP8_PARAMS", ())


def scale_region(region: Region) -> Region | None:
    """The region of a kept parameter's scales that a part's scales fill: the part's region
    with its rows (dim 0 of the weight, or of one expert) in blocks; None when the part does
    not start on a block boundary or is not split by rows."""
    match region:
        case Whole():
            return region
        case Index(0, index):
            return region
        case Slice(0, start, length) if start % BLOCK == 0:
            return Slice(0, start // BLOCK, -(-length // BLOCK))
        case IndexSlice(0, index, 0, start, length) if start % BLOCK == 0:
            return IndexSlice(0, index, 0, start // BLOCK, -(-length // BLOCK))
        case _:
            return None


def keep_fp8(model: nn.Module, kept: frozenset[str], pow2: bool) -> None:
    """Make each kept parameter of the meta `model` fp8, with its float32 scales beside it: an
    nn.Linear becomes an Fp8Linear, a module's FP8_PARAMS get `P_scale_inv` [..., ceil(rows /
    128), ceil(cols / 128)], which its parts' scales tile: each starts on a block boundary
    (`plan_fp8`), so only the last can end inside a block. The loader allocates them. `pow2`
    (a ue8m0 checkpoint): their products round the activation scales up to powers of two."""
    meta = torch.device("meta")
    for target in sorted(kept):
        owner, _, attr = target.rpartition(".")
        module = model.get_submodule(owner)
        if type(module) is nn.Linear:
            parent, _, child = owner.rpartition(".")
            swapped = Fp8Linear(module.in_features, module.out_features, meta, pow2)
            setattr(model.get_submodule(parent), child, swapped)
            continue
        if not hasattr(module, POW2_FLAG):
            raise TypeError(f"{owner} lists FP8_PARAMS but has no {POW2_FLAG} to honour")
        setattr(module, POW2_FLAG, pow2)
        shape = getattr(module, attr).shape  # [..., rows, cols]
        weight = torch.empty(shape, dtype=FP8_DTYPE, device=meta)
        blocks = (*shape[:-2], *scale_shape(shape[-2], shape[-1]))
        setattr(module, attr, nn.Parameter(weight, requires_grad=False))
        scale = torch.empty(blocks, dtype=torch.float32, device=meta)
        setattr(module, attr + SCALE_SUFFIX, nn.Parameter(scale, requires_grad=False))


def is_fp8_param(name: str, p: torch.Tensor) -> bool:
    """Whether a parameter is one `keep_fp8` made (allocated in its own dtype)."""
    return p.dtype == FP8_DTYPE or name.endswith(SCALE_SUFFIX)
