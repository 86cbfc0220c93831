"""Attention backends by name: `torch` (plain SDPA, CPU and CUDA; the CPU's default) and
`triton` (Triton kernels; CUDA's default, or the CPU under TRITON_INTERPRET=1 for tests; over
MLA's latent pool, attention/mla_backend.py).

`triton` is imported only when asked for: a machine without the package, or a process that
never uses it, never loads Triton (and its interpreter switch is read at that import)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from pdserve.attention.backend import AttentionBackend, AttentionShape
from pdserve.attention.torch_backend import TorchBackend
from pdserve.kvcache.layout import LATENT
from pdserve.kvcache.pool import KVPool


def _triton(pool: KVPool, shape: AttentionShape) -> AttentionBackend[Any]:
    """TritonBackend over k and v; MLABackend over a latent pool (its decodes absorbed)."""
    try:
        from pdserve.attention.mla_backend import MLABackend
        from pdserve.attention.triton_backend import TritonBackend
    except ImportError as e:
        raise ValueError(f"attention backend 'triton' needs the triton package: {e}") from None
    from pdserve.attention.triton_common import interpreted
    from pdserve.attention.triton_decode import _decode_kernel

    if pool.device.type != "cuda" and not interpreted(_decode_kernel):
        raise ValueError(
            f"attention backend 'triton' runs on CUDA (the pool is on {pool.device}); "
            "use 'torch', or TRITON_INTERPRET=1 before the first import of triton for tests"
        )
    if LATENT in {b.name for b in pool.layout.buffers}:
        return MLABackend(pool, shape)
    return TritonBackend(pool, shape)


BACKENDS: dict[str, Callable[[KVPool, AttentionShape], AttentionBackend[Any]]] = {
    "torch": TorchBackend,
    "triton": _triton,
}


def default_backend(device: torch.device) -> str:
    """The backend a device gets when none is named: `triton` on CUDA where the package is
    installed (the backend the GPU tests and benchmarks exercise: benchmarks/RESULTS.md), else
    `torch`."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def make_backend(name: str, pool: KVPool, model_arch: AttentionShape) -> AttentionBackend[Any]:
    """Backend `name` over `pool`'s KV, for a model of `model_arch`'s attention shape."""
    factory = BACKENDS.get(name)
    if factory is None:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    return factory(pool, model_arch)
