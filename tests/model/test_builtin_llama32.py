"""The `llama3.2-1b-shape` built-in: Llama-3.2-1B's exact dimensions, checked without writing
its 2.5 GB of weights (the config, the checkpoint's tensor plan and meta-device models), and
its weight writer checked at a shrunken width (deterministic, sharded as at full size)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from pdserve.model import builtin, builtin_weights
from pdserve.model.builtin_specs import BUILTIN_NAMES, BuiltinSpec, builtin_spec
from pdserve.model.config import ModelArch
from pdserve.model.corpus import ENDOFTEXT, IM_END
from pdserve.model.llama import CausalLM, rope_inv_freq
from pdserve.model.weight_map import plan, rules_for

NAME = "llama3.2-1b-shape"
# Meta's published count for Llama-3.2-1B (the tied head counted once).
LLAMA32_1B_PARAMS = 1_235_814_400


def _config() -> dict[str, Any]:
    # The special tokens' ids only fill bos/eos/pad fields; training the tokenizer to learn
    # them is not what this file tests.
    return builtin._hf_config(builtin_spec(NAME), {ENDOFTEXT: 4093, IM_END: 4095})


def test_is_a_builtin_name() -> None:
    assert NAME in BUILTIN_NAMES
    assert builtin_spec(NAME).name == NAME


def test_pdserve_reads_llama32_1b_dimensions() -> None:
    arch = ModelArch.from_hf_config(_config())
    assert (arch.architecture, arch.family) == ("LlamaForCausalLM", "llama")
    assert (arch.hidden_size, arch.intermediate_size, arch.num_layers) == (2048, 8192, 16)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (32, 8, 64)
    assert arch.vocab_size == 128_256
    assert arch.tie_word_embeddings
    assert not (arch.qkv_bias or arch.o_bias or arch.mlp_bias or arch.qk_norm)
    assert arch.rope_theta == 500_000.0
    assert arch.rms_norm_eps == 1e-5
    assert arch.max_position_embeddings == 131_072
    rs = arch.rope_scaling
    assert (rs.rope_type, rs.factor, rs.original_max_position_embeddings) == ("llama3", 32.0, 8192)
    assert (rs.low_freq_factor, rs.high_freq_factor) == (1.0, 4.0)
    assert arch.torch_dtype == "bfloat16"


def test_checkpoint_plan_covers_the_model_with_1_24b_parameters() -> None:
    spec = builtin_spec(NAME)
    shards = builtin_weights._shard_inits(spec)
    assert len(shards) == 4
    planned = {n: init.shape for shard in shards for n, init in shard.items()}
    assert sum(len(s) for s in shards) == len(planned)  # no tensor in two shards
    assert sum(math.prod(s) for s in planned.values()) == LLAMA32_1B_PARAMS
    with torch.device("meta"):
        model = CausalLM(ModelArch.from_hf_config(_config()))
    model.tie_weights()
    # named_parameters drops the tied lm_head: the checkpoint must cover exactly the rest,
    # through the loader's weight map (q/k/v and gate/up are fused parameters).
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    placements = plan(planned, params, rules_for("LlamaForCausalLM"), set(), where=NAME)
    assert {pl.target for pl in placements} == set(params)
    assert "lm_head.weight" not in planned


def test_transformers_builds_the_same_model() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**_config())
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == LLAMA32_1B_PARAMS
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # HF's Llama-3 RoPE frequencies from this config equal the ones pdserve computes.
    arch = ModelArch.from_hf_config(_config())
    ours = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
    theirs = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config).inv_freq
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


def _shrunken() -> BuiltinSpec:
    """Same name (so the same per-tensor seeds), layers and shards; a small width."""
    return dataclasses.replace(
        builtin_spec(NAME),
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        vocab_size=4096,
    )


def _digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_shrunken_weights_are_deterministic_and_sharded(tmp_path: Path) -> None:
    spec = _shrunken()
    for out in ("a", "b"):
        (tmp_path / out).mkdir()
        builtin_weights.write_weights(spec, tmp_path / out)
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")
    shards = [f"model-{k:05d}-of-00004.safetensors" for k in range(1, 5)]
    assert sorted(_digests(tmp_path / "a")) == sorted([*shards, "model.safetensors.index.json"])
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    stored: dict[str, str] = {}
    for shard in shards:
        with safe_open(str(tmp_path / "a" / shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                assert f.get_slice(name).get_dtype() == "BF16"
                stored[name] = shard
    assert index["weight_map"] == stored
    assert stored["model.embed_tokens.weight"] == shards[0]
    assert stored["model.layers.3.mlp.down_proj.weight"] == shards[0]
    assert stored["model.layers.4.mlp.down_proj.weight"] == shards[1]
    assert stored["model.norm.weight"] == shards[3]
    assert "lm_head.weight" not in stored
