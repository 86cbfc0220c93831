"""DeepSeek-V4's config: read as HF's DeepseekV4Config reads it (legacy fields folded the same
way, the same rope tables), refused by name where we would run something else, and usable as
the KV layout's V4Shape."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.kvcache import v4_layout
from pdserve.kvcache.v4_layout import v4_buffers, v4_state
from pdserve.model.config import ModelArch, ModelConfigError
from pdserve.model.deepseek_v4 import config as v4_config
from pdserve.model.deepseek_v4.config import V4Arch
from pdserve.model.deepseek_v4.rope import RopeTable

transformers = pytest.importorskip("transformers")
hf_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

DROP = object()  # a config field to delete
SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# The fields each variant below derives in its own way, dropped from the tiny model's config.
DERIVED = ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters")
YARN = {"factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 32, "beta_slow": 1}


@pytest.fixture(scope="module")
def config(builtin_dir: Any) -> dict[str, Any]:
    return dict(json.loads((Path(builtin_dir("deepseek-v4-tiny")) / "config.json").read_text()))


def test_the_tiny_model_reads_as_specified(config: dict[str, Any]) -> None:
    arch = ModelArch.from_hf_config(config)
    v4 = arch.v4
    assert v4 is not None and arch.family == "deepseek_v4" and arch.num_kv_heads == 1
    assert v4.layer_types == (SWA, CSA, HCA, CSA, HCA)
    assert v4.mlp_layer_types == ("hash_moe", "hash_moe", "moe", "moe", "moe")
    assert (v4.csa_ratio, v4.hca_ratio, v4.sliding_window, v4.index_topk) == (4, 128, 16, 8)
    assert (v4.main_rope.dim, v4.compress_rope.dim) == (16, 16)
    assert v4.compress_rope.scaling.rope_type == "yarn"
    assert [v4.ratio(i) for i in range(5)] == [None, 4, 128, 4, 128]
    # V4Arch is the layout's V4Shape, with the same layer type names.
    assert (v4_config.SWA, v4_config.CSA, v4_config.HCA) == (
        v4_layout.SWA, v4_layout.CSA, v4_layout.HCA,
    )  # fmt: skip
    assert [b.name for b in v4_buffers(v4, "float32", 128)] == [
        "csa.kv", "csa.index_k", "hca.kv", "swa.page_ring", "csa.page_overlap_kv",
        "csa.page_overlap_gate", "csa.page_index_overlap_kv", "csa.page_index_overlap_gate",
    ]  # fmt: skip
    state = {s.name: s for s in v4_state(v4, "float32")}
    assert state["swa.ring"].shape == (16, 32) and state["swa.ring"].layers == tuple(range(5))
    assert state["hca.tail_kv"].shape == (127, 32) and state["hca.tail_kv"].layers == (2, 4)
    assert state["csa.index_overlap_gate"].dtype == "float32"


VARIANTS = {
    "defaults": {},  # 2 HCA layers then CSA/HCA; 3 hash layers; rotary factor 64/512
    "deepseek's legacy fields": {
        "compress_ratios": [0, 4, 128, 4, 128, 4],  # one more: the MTP layer's
        "num_hash_layers": 2,
        "qk_rope_head_dim": 16,
        "rope_scaling": {"type": "yarn", **YARN},
    },
    "flat rope_parameters": {
        "rope_parameters": {"rope_type": "yarn", **YARN},
        "partial_rotary_factor": 0.25,
        "compress_rate_csa": 8,
    },
    "nested, YaRN's own attention factor": {
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25},
            "compress": {
                "rope_type": "yarn",
                **YARN,
                "rope_theta": 1e5,
                "partial_rotary_factor": 0.5,
            },
        },
    },  # fmt: skip
}


@pytest.mark.parametrize("extra", VARIANTS.values(), ids=VARIANTS.keys())
def test_fields_fold_as_hf_folds_them(config: dict[str, Any], extra: dict[str, Any]) -> None:
    cfg = {**{k: v for k, v in config.items() if k not in DERIVED}, **extra}
    hf = transformers.DeepseekV4Config(**copy.deepcopy(cfg))  # it edits nested dicts
    v4 = V4Arch.from_hf_config(cfg)
    assert v4.layer_types == tuple(hf.layer_types)
    assert v4.mlp_layer_types == tuple(hf.mlp_layer_types)
    assert {CSA: v4.csa_ratio, HCA: v4.hca_ratio} == hf.compress_rates
    rotary = hf_v4.DeepseekV4RotaryEmbedding(hf)
    for table, spec in (("main", v4.main_rope), ("compress", v4.compress_rope)):
        ours = RopeTable.build(spec, torch.device("cpu"))
        assert torch.equal(ours.inv_freq, getattr(rotary, f"{table}_inv_freq")), table
        assert ours.factor == getattr(rotary, f"{table}_attention_scaling"), table


NESTED_WITHOUT_FACTOR = {"main": {"rope_theta": 1e4}, "compress": {"rope_theta": 1e5}}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"num_hidden_layers": DROP}, "required field 'num_hidden_layers' is missing"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' not supported"),
        ({"num_key_value_heads": 2}, "num_key_value_heads 2 not supported; V4's is 1"),
        ({"n_shared_experts": 2}, "n_shared_experts 2 not supported"),
        ({"norm_topk_prob": False}, "norm_topk_prob False not supported"),
        ({"mlp_bias": True}, "mlp_bias True not supported"),
        ({"layer_types": [SWA, CSA]}, "layer_types has 2 entries for 5 layers"),
        ({"layer_types": [SWA] * 4 + ["full_attention"]}, r"layer_types entries must be in"),
        ({"mlp_layer_types": ["moe"] * 4 + ["dense"]}, r"mlp_layer_types entries must be in"),
        ({"layer_types": DROP, "compress_ratios": [0, 4, 64]}, "compress_ratios entries must"),
        ({"compress_rates": {CSA: 4}}, "compress_rates must name exactly"),
        ({"compress_rates": {CSA: 0, HCA: 128}}, "csa_ratio must be an int >= 1, got 0"),
        ({"sliding_window": 1}, "sliding_window must be >= 2, got 1"),
        ({"sliding_window": None}, "required field 'sliding_window' is missing"),
        ({"o_groups": 3}, "does not split into o_groups 3"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 > n_routed_experts 8"),
        ({"index_topk": 0}, "index_topk must be an int >= 1, got 0"),
        ({"hc_mult": 2.5}, "hc_mult must be an int >= 1, got 2.5"),
        ({"hc_eps": 0}, "hc_eps must be > 0"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax' not supported"),
        ({"index_head_dim": 8}, "index_head_dim 8 is narrower than the compress rope"),
        ({"dtype": "float64", "torch_dtype": None}, "dtype 'float64' not supported"),
        ({"rope_parameters": NESTED_WITHOUT_FACTOR}, "has no partial_rotary_factor"),
        ({"rope_parameters": {"rope_type": "llama3"}}, "compress rope's type 'llama3'"),
        ({"rope_parameters": {"rope_type": "yarn"}}, "yarn rope needs 'factor'"),
        ({"partial_rotary_factor": 0.1, "rope_parameters": None}, "rotated width 3"),
    ],
)
def test_what_cannot_run_is_refused_by_name(
    config: dict[str, Any], change: dict[str, Any], named: str
) -> None:
    cfg = {**config, **change}
    cfg = {k: v for k, v in cfg.items() if v is not DROP}
    with pytest.raises(ModelConfigError, match=named) as e:
        ModelArch.from_hf_config(cfg, where="m/config.json")
    assert str(e.value).startswith("m/config.json: ")
