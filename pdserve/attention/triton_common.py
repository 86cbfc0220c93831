"""What the Triton attention kernels share: the dtype a kernel multiplies in, and whether
Triton runs them compiled on a GPU or in its CPU interpreter.

The interpreter (`TRITON_INTERPRET=1`, read by `triton.jit` when a kernel module is imported)
runs the same kernels on CPU tensors, in numpy: that is how the CPU test tier checks them.
Its `tl.dot` multiplies bfloat16 blocks as raw 16-bit integers (numpy has no bfloat16), so
under the interpreter bfloat16 operands are multiplied in float32 instead; compiled, they
stay bfloat16 on the tensor cores. float32 operands are multiplied exactly ("ieee"), not in
TF32: a float32 model must match its float32 reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# The dtypes q (and so the output) may have; the pool may hold any float dtype.
DOT_DTYPES: dict[torch.dtype, tl.dtype] = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
}
LOG2E = 1.4426950408889634  # the kernels use exp2: e**x == 2**(x * LOG2E)
MIN_DOT = 16  # tl.dot's smallest block side


def interpreted(kernel: object) -> bool:
    """Whether `kernel` (a `triton.jit` function) runs in the CPU interpreter."""
    return isinstance(kernel, InterpretedFunction)


def dot_dtype(q_dtype: torch.dtype, kernel: object) -> tl.dtype:
    """The dtype a kernel's tl.dot operands have for queries of `q_dtype`."""
    if q_dtype not in DOT_DTYPES:
        raise ValueError(
            f"the triton attention backend takes queries in {sorted(map(str, DOT_DTYPES))}, "
            f"got {q_dtype}"
        )
    if q_dtype == torch.bfloat16 and interpreted(kernel):
        return tl.float32
    return DOT_DTYPES[q_dtype]


def dot_precision(dtype: tl.dtype) -> str:
    """tl.dot's input_precision for operands of `dtype` (ignored unless float32)."""
    return "ieee" if dtype == tl.float32 else "tf32"


def block(n: int, at_least: int = MIN_DOT) -> int:
    """A power-of-two block side that covers n (and is at least `at_least`)."""
    return max(at_least, triton.next_power_of_2(n))


def check_cache(cache: torch.Tensor, what: str) -> None:
    """A pool view the kernels can address: [num_pages, page_size, kv_heads, head_dim]."""
    if cache.dim() != 4:
        raise ValueError(
            f"{what} must be [pages, page_size, kv_heads, head_dim], got {tuple(cache.shape)}"
        )
