"""Programmatic dependent launch (PDL): a Triton kernel is scheduled while the kernel before it
in the stream is still finishing, and waits on the device, not in the launch queue.

Why: a CUDA-graph decode step is a couple of hundred kernels of a few microseconds each, and
between two of them the GPU drains one grid and only then starts launching the next; those
gaps add up to a visible share of a step (`benchmarks/kernels/gpu_kernels.py --step tick`;
benchmarks/RESULTS.md, 2026-12-02 second and third sessions). On sm_90 and later a kernel
launched with PDL may have its blocks placed as soon as the kernel before it lets them
(`griddepcontrol.launch_dependents`, or that kernel's end); its `griddepcontrol.wait` then
holds it until the kernel before has completed and its writes are visible.

The rule every kernel launched this way follows: `enter(PDL, LAUNCH_NEXT)` is its first
statement, so it reads nothing and writes nothing before the kernel ahead of it has
completed; its results are the same bits as without PDL. With LAUNCH_NEXT it also lets the
next kernel's blocks be placed at once: they wait in their own `enter` (a kernel launched
without PDL, cuBLAS's, starts only after this one completes, as always). So stream order,
graph capture and replay keep their meaning; what overlaps is launch latency, never work.
LAUNCH_NEXT is off where the early blocks would crowd this kernel's (attention/triton_store.py).

Off below sm_90, on ROCm, with a Triton older than 3.4, under Triton's CPU interpreter (it
has no such instructions), and with PDSERVE_PDL=0 in the environment when the process first
launches a kernel (read once).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

_enabled: dict[int, bool] = {}  # by CUDA device index; read once per process


def _triton_has_pdl() -> bool:
    """Triton >= 3.4 (the `launch_pdl` launch option, the griddepcontrol intrinsics); the
    Triton an older torch brings has neither, and its kernels then launch plainly."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # a Triton without the NVIDIA backend
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl.extra.cuda, "gdc_wait")


def enabled(device: torch.device, kernel: object) -> bool:
    """Whether `kernel` (a triton.jit function) launches with PDL for tensors on `device`.
    The capability is the current CUDA device's: Triton compiles for it, whatever the tensors
    say (a process serving one GPU is pinned to it, runtime/gpus.pin_to_device)."""
    if device.type != "cuda" or isinstance(kernel, InterpretedFunction) or torch.version.hip:
        return False  # ROCm reports CUDA devices too, with capabilities like (9, 4)
    index = torch.cuda.current_device()
    if index not in _enabled:
        major, _ = torch.cuda.get_device_capability(index)
        _enabled[index] = (
            major >= 9 and os.environ.get("PDSERVE_PDL", "1") != "0" and _triton_has_pdl()
        )
    return _enabled[index]


def launch(device: torch.device, kernel: object) -> dict[str, bool]:
    """The launch options and the `PDL` constexpr for `kernel` on `device`:
    `kernel[grid](..., **launch(x.device, kernel))`."""
    on = enabled(device, kernel)
    return {"PDL": on, "launch_pdl": on} if on else {"PDL": False}


@triton.jit
def enter(PDL: tl.constexpr, LAUNCH_NEXT: tl.constexpr):
    """A PDL kernel's first statement: wait until the kernel ahead has completed (its writes
    visible); with LAUNCH_NEXT, let the next kernel's blocks be placed now, beside this
    kernel's, to wait in their own `enter` (else they are placed when this kernel ends)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if LAUNCH_NEXT:
            tl.extra.cuda.gdc_launch_dependents()
