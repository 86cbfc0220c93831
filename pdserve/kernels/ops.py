"""The fused ops a model calls: a Triton kernel for CUDA tensors, the torch reference for the
rest (kernels/reference.py). Triton is imported on the first CUDA call only, so a CPU process
never loads it."""

from __future__ import annotations

from types import ModuleType

import torch

from pdserve.kernels import reference

_triton: ModuleType | None = None


def _kernels() -> ModuleType:
    global _triton
    if _triton is None:
        from pdserve.kernels import triton_fused

        _triton = triton_fused
    return _triton


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
