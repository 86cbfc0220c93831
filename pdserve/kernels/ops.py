"""The fused ops a model calls: a Triton kernel for CUDA tensors, the torch reference for the
rest (kernels/reference.py). Triton is imported on the first CUDA call only, so a CPU process
never loads it.

The weight products (`linear`, `silu_mul_linear`) of a single 16-bit row on CUDA, the
batch-1 decode step, take the Triton GEMV (kernels/triton_gemv.py), which beat cuBLAS on every
layer matrix of the built-in shapes (benchmarks/kernels/gemv.py); every other product stays on
cuBLAS through F.linear, float32 (the parity oracle) included.

A mixture of experts' routed experts on CUDA take the fused grouped GEMMs
(kernels/triton_moe.py) when `fused_moe_applies`; $PDSERVE_FUSED_MOE overrides the choice:
"0" keeps the torch loop on CUDA too, "1" takes the fused path on any device (CPU tensors only
under TRITON_INTERPRET=1, which is how the CPU tests run it). Read at each call.

A product with an fp8 block-scaled weight (`fp8_linear`, DeepSeek's checkpoints kept in fp8)
takes the Triton kernels (kernels/triton_fp8.py: the activation quantised per group, then the
fp8 GEMM) for CUDA tensors and the torch reference (kernels/fp8_blocks.py) otherwise;
$PDSERVE_FP8_TRITON overrides it the same way: "0" the reference everywhere, "1" Triton on
any device. Read at each call. `pow2` (fp8_linear, fused_moe): the activation scales rounded up
to powers of two, as DeepSeek does for its ue8m0 checkpoints."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch
import torch.nn.functional as F

from pdserve.kernels import fp8_blocks, reference

_triton: ModuleType | None = None
_triton_gemv: ModuleType | None = None
_triton_moe: ModuleType | None = None
_triton_fp8: ModuleType | None = None
FUSED_MOE_ENV = "PDSERVE_FUSED_MOE"
FP8_TRITON_ENV = "PDSERVE_FP8_TRITON"


def _kernels() -> ModuleType:
    global _triton
    if _triton is None:
        from pdserve.kernels import triton_fused

        _triton = triton_fused
    return _triton


def _gemv(x: torch.Tensor, weight: torch.Tensor) -> ModuleType | None:
    """kernels/triton_gemv when it takes this product (one 16-bit CUDA row), else None."""
    global _triton_gemv
    if not (x.is_cuda and x.dim() == 2 and x.shape[0] == 1):
        return None
    if _triton_gemv is None:
        from pdserve.kernels import triton_gemv

        _triton_gemv = triton_gemv
    return _triton_gemv if _triton_gemv.supports(x, weight) else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[N, K] @ [O, K].T (+ bias) -> [N, O]: F.linear."""
    gemv = _gemv(x, weight)
    if gemv is not None:
        return gemv.gemv(x, weight, bias)  # type: ignore[no-any-return]
    return F.linear(x, weight, bias)


def silu_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """linear(silu_mul(gate_up), weight, bias): an MLP's down projection of its gate-up output,
    in one kernel where the GEMV takes it (the same bits as the two ops)."""
    gemv = _gemv(gate_up, weight)
    if gemv is not None:
        return gemv.gemv(gate_up, weight, bias, silu_mul=True)  # type: ignore[no-any-return]
    return F.linear(silu_mul(gate_up), weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[N, D] -> [N, D]."""
    if x.is_cuda and x.stride(-1) == 1:
        return _kernels().rms_norm(x, weight, eps)  # type: ignore[no-any-return]
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual). On CUDA `residual` is updated in place."""
    if x.is_cuda and x.stride(-1) == 1 and residual.is_contiguous():
        return _kernels().rms_norm(x, weight, eps, residual), residual
    return reference.add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate then up) -> silu(gate) * up, [N, I]."""
    if gate_up.is_cuda and gate_up.stride(-1) == 1:
        return _kernels().silu_mul(gate_up)  # type: ignore[no-any-return]
    return reference.silu_mul(gate_up)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hkv, D] rotated by their positions (in place on CUDA)."""
    if q.is_cuda and q.stride(-1) == 1 and k.stride(-1) == 1:
        return _kernels().rotary(q, k, positions, inv_freq)  # type: ignore[no-any-return]
    return reference.rotary(q, k, positions, inv_freq)


def fused_moe_applies(x: torch.Tensor) -> bool:
    """Whether a mixture of experts' routed experts for tokens `x` take `fused_moe`: on CUDA
    with Triton installed, unless $PDSERVE_FUSED_MOE says otherwise (module docstring)."""
    forced = os.environ.get(FUSED_MOE_ENV, "")
    if forced in ("0", "1"):
        return forced == "1"
    return x.is_cuda and importlib.util.find_spec("triton") is not None


def fused_moe(
    x: torch.Tensor,  # [N, H]
    ids: torch.Tensor,  # [N, top_k]
    weights: torch.Tensor,  # [N, top_k] float32
    gate_up_proj: torch.Tensor,  # [E, 2I, H]
    down_proj: torch.Tensor,  # [E, H, I]
    gate_up_scale: torch.Tensor | None = None,  # fp8 experts: [E, 2I / 128, H / 128] float32
    down_scale: torch.Tensor | None = None,  # [E, H / 128, I / 128]
    pow2: bool = False,  # fp8 experts: power-of-two activation scales
) -> torch.Tensor:  # [N, H]
    """The routed experts' weighted sum per token in Triton, with no host synchronisation;
    fp8 experts (both scales given) multiply block-scaled, as kernels/fp8_blocks.py says."""
    global _triton_moe
    if _triton_moe is None:
        from pdserve.kernels import triton_moe

        _triton_moe = triton_moe
    return _triton_moe.fused_moe(  # type: ignore[no-any-return]
        x, ids, weights, gate_up_proj, down_proj,
        gate_up_scale=gate_up_scale, down_scale=down_scale, pow2=pow2,
    )  # fmt: skip


def fp8_triton_applies(x: torch.Tensor) -> bool:
    """Whether `fp8_linear` of tokens `x` takes the Triton kernels: on CUDA, unless
    $PDSERVE_FP8_TRITON says otherwise (module docstring)."""
    forced = os.environ.get(FP8_TRITON_ENV, "")
    if forced in ("0", "1"):
        return forced == "1"
    return x.is_cuda


def fp8_linear(
    x: torch.Tensor,  # [N, K], the model's dtype
    weight: torch.Tensor,  # [O, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [ceil(O / 128), ceil(K / 128)] float32
    pow2: bool = False,  # the activation scales rounded up to powers of two
) -> torch.Tensor:  # [N, O], x's dtype
    """x @ the fp8 block-scaled weight, the activation quantised per group of 128: the
    Triton kernels where `fp8_triton_applies`, else the torch reference."""
    if not fp8_triton_applies(x):
        return fp8_blocks.linear(x, weight, weight_scale, pow2=pow2)
    global _triton_fp8
    if _triton_fp8 is None:
        from pdserve.kernels import triton_fp8

        _triton_fp8 = triton_fp8
    x = x if x.stride(-1) == 1 else x.contiguous()  # the kernel reads rows of unit stride
    return _triton_fp8.linear(x, weight, weight_scale, pow2=pow2)  # type: ignore[no-any-return]
