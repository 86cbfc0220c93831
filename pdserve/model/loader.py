"""Load an HF checkpoint directory (single or sharded safetensors) into a CausalLM.

The model is built on the meta device and materialised empty on the target device, so a
large checkpoint costs one copy of its weights, not a random init followed by a copy.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.model.config import ModelArch, ModelConfigError
from pdserve.model.llama import CausalLM, rope_inv_freq

log = logging.getLogger(__name__)

# Checkpoint entries that some exporters write and that we derive ourselves.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, arch: ModelArch) -> torch.dtype:
    """'auto' = the checkpoint's torch_dtype."""
    if name == "auto":
        name = arch.torch_dtype
    if name not in DTYPES:
        raise ModelConfigError(f"dtype {name!r} not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelConfigError(f"{path}: shards listed in the index are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelConfigError(
        f"{path}: no weights found (expected model.safetensors or model.safetensors.index.json)"
    )


def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    arch = ModelArch.from_dir(path)
    files = weight_files(path)
    with torch.device("meta"):
        model = CausalLM(arch)
    model = model.to_empty(device=device)
    model.to(dtype)
    # The RoPE table is computed, not loaded; keep it in float32 like the reference.
    model.inv_freq = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling).to(device)
    params = dict(model.named_parameters())
    if arch.tie_word_embeddings:
        params.pop("lm_head.weight")
    loaded: set[str] = set()
    unexpected: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if arch.tie_word_embeddings and name == "lm_head.weight":
                    continue
                target = params.get(name)
                if target is None:
                    unexpected.append(name)
                    continue
                tensor = st.get_tensor(name)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ModelConfigError(
                        f"{f.name}: tensor {name} has shape {tuple(tensor.shape)}, "
                        f"config.json implies {tuple(target.shape)}"
                    )
                with torch.no_grad():
                    target.copy_(tensor.to(dtype))
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelConfigError(
            f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}"
        )
    if unexpected:
        raise ModelConfigError(
            f"{path}: checkpoint has {len(unexpected)} tensors this architecture does not use, "
            f"e.g. {unexpected[:3]}"
        )
    model.tie_weights()
    model.eval()
    log.info(
        "loaded %s (%s) from %s on %s as %s", arch.architecture, arch.family, path, device, dtype
    )
    return model
