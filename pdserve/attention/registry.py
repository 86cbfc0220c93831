"""Attention backends by name. `torch` is the only one today, and the default everywhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pdserve.attention.backend import AttentionBackend, AttentionShape
from pdserve.attention.torch_backend import TorchBackend
from pdserve.kvcache.pool import KVPool

BACKENDS: dict[str, Callable[[KVPool, AttentionShape], AttentionBackend[Any]]] = {
    "torch": TorchBackend,
}


def default_backend(device: torch.device) -> str:
    """The backend a device gets when none is named."""
    return "torch"


def make_backend(name: str, pool: KVPool, model_arch: AttentionShape) -> AttentionBackend[Any]:
    """Backend `name` over `pool`'s KV, for a model of `model_arch`'s attention shape."""
    factory = BACKENDS.get(name)
    if factory is None:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    return factory(pool, model_arch)
