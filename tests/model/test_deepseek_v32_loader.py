"""Loading DeepSeek-V3.2 checkpoints: the indexer's weights by name, its weights_proj kept
float32 in a bf16 model (as HF keeps it), MTP layers skipped as for V3, and V3.2 configs we
would read differently from HF refused by name."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.model.config import ModelArch, ModelConfigError
from pdserve.model.deepseek_v32 import DeepseekV32ForCausalLM
from pdserve.model.loader import load_model

CPU = torch.device("cpu")
IX = "model.layers.{}.self_attn.indexer."
DROP = object()  # a config field to delete


@pytest.fixture(scope="module")
def ds_dir(builtin_dir) -> Path:
    return builtin_dir("deepseek-v32-tiny")


def test_indexer_weights_load_by_name_and_weights_proj_stays_float32(ds_dir) -> None:
    tensors = load_file(str(ds_dir / "model.safetensors"))
    model = load_model(ds_dir, torch.bfloat16, CPU)
    assert isinstance(model, DeepseekV32ForCausalLM)
    params = dict(model.named_parameters())
    for layer in range(3):
        p = IX.format(layer)
        for name in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias"):
            assert params[p + name].dtype == torch.bfloat16
            assert torch.equal(params[p + name], tensors[p + name].to(torch.bfloat16))
        w = params[p + "weights_proj.weight"]
        assert w.dtype == torch.float32 and torch.equal(w, tensors[p + "weights_proj.weight"])
    assert params["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert params["model.layers.0.self_attn.q_b_proj.weight"].dtype == torch.bfloat16


def test_mtp_layers_are_skipped(ds_dir, tmp_path) -> None:
    path = tmp_path / "mtp"
    shutil.copytree(ds_dir, path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors[IX.format(3) + "wk.weight"] = torch.zeros(32, 128)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(128, 256)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    assert load_model(path, torch.float32, CPU).arch.num_layers == 3


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"q_lora_rank": None}, "DeepSeek-V3.2 needs q_lora_rank"),
        ({"index_topk": 0}, "index_topk must be >= 1, got 0"),
        ({"index_n_heads": DROP}, "required field 'index_n_heads' is missing"),
        ({"mlp_layer_types": ["dense"] * 3}, "mlp_layer_types .* is not first_k_dense_replace=1"),
    ],
)
def test_what_cannot_run_is_refused_by_name(ds_dir, config, named) -> None:
    cfg = json.loads((ds_dir / "config.json").read_text())
    cfg.update(config)
    cfg = {k: v for k, v in cfg.items() if v is not DROP}
    with pytest.raises(ModelConfigError, match=named):
        ModelArch.from_hf_config(cfg)


def test_mlp_layer_types_as_hf_writes_them_are_read(ds_dir) -> None:
    cfg = json.loads((ds_dir / "config.json").read_text())
    arch = ModelArch.from_hf_config({**cfg, "mlp_layer_types": ["dense", "sparse", "sparse"]})
    assert arch.dsa is not None and arch.architecture == "DeepseekV32ForCausalLM"


def test_index_k_dtype_flag_reaches_the_cache_config_and_launch_passes_it_on(ds_dir) -> None:
    from pdserve import launch
    from pdserve.config import CacheConfig
    from pdserve.engine_flags import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--model", str(ds_dir), "--device", "cpu", "--index-k-dtype", "fp8"])
    assert engine_config(args).cache.index_k_dtype == "fp8"
    argv = launch.engine_flags(args)  # what `pdserve launch` gives each worker
    assert argv[argv.index("--index-k-dtype") + 1] == "fp8"
    assert engine_config(p.parse_args(["--model", str(ds_dir)])).cache.index_k_dtype == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--index-k-dtype", "int4"])
    with pytest.raises(ValueError, match="index-K dtype must be one of"):
        CacheConfig(index_k_dtype="fp4")
