"""Loading DeepSeek-V3 checkpoints: per-expert tensors stacked (and HF 5's stacked names as they
are), fp8 block-quantised weights dequantised, multi-token prediction layers skipped, and what
cannot run refused with an error that names it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.model.config import ModelArch, ModelConfigError
from pdserve.model.loader import load_model
from pdserve.model.weight_map import plan, rules_for

CPU = torch.device("cpu")
E, WIDTH = 8, 64  # deepseek-v3-tiny's routed experts and their width


@pytest.fixture(scope="module")
def ds_dir(builtin_dir) -> Path:
    return builtin_dir("deepseek-v3-tiny")


@pytest.fixture(scope="module")
def tensors(ds_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ds_dir / "model.safetensors"))


def variant(src: Path, dst: Path, tensors: dict[str, torch.Tensor], **config: object) -> Path:
    """A copy of `src` with these tensors and config.json fields (None deletes a field)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_per_expert_tensors_are_stacked_with_gate_and_up_fused(ds_dir, tensors) -> None:
    params = dict(load_model(ds_dir, torch.float32, CPU).named_parameters())
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp."
        gate_up, down = params[p + "experts.gate_up_proj"], params[p + "experts.down_proj"]
        assert gate_up.shape == (E, 2 * WIDTH, 128) and down.shape == (E, 128, WIDTH)
        for e in range(E):
            assert torch.equal(gate_up[e, :WIDTH], tensors[p + f"experts.{e}.gate_proj.weight"])
            assert torch.equal(gate_up[e, WIDTH:], tensors[p + f"experts.{e}.up_proj.weight"])
            assert torch.equal(down[e], tensors[p + f"experts.{e}.down_proj.weight"])
        shared = params[p + "shared_experts.gate_up_proj.weight"]
        assert torch.equal(shared[:WIDTH], tensors[p + "shared_experts.gate_proj.weight"])
        bias = params[p + "gate.e_score_correction_bias"]
        assert bias.abs().min() > 0 and torch.equal(
            bias, tensors[p + "gate.e_score_correction_bias"]
        )


def test_router_stays_float32_in_a_bfloat16_model(ds_dir) -> None:
    params = dict(load_model(ds_dir, torch.bfloat16, CPU).named_parameters())
    assert params["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert params["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert params["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.bfloat16


def test_hf5_stacked_expert_names_load_as_they_are(ds_dir, tensors, tmp_path) -> None:
    stacked = {}
    for name, t in tensors.items():
        if ".experts." not in name:
            stacked[name] = t
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts."
        stacked[p + "gate_up_proj"] = torch.stack(
            [
                torch.cat([tensors[p + f"{e}.{w}_proj.weight"] for w in ("gate", "up")])
                for e in range(E)
            ]
        )
        stacked[p + "down_proj"] = torch.stack(
            [tensors[p + f"{e}.down_proj.weight"] for e in range(E)]
        )
    want = dict(load_model(ds_dir, torch.float32, CPU).named_parameters())
    got = dict(
        load_model(variant(ds_dir, tmp_path / "v", stacked), torch.float32, CPU).named_parameters()
    )
    assert want.keys() == got.keys()
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_a_missing_expert_half_is_named(ds_dir, tensors) -> None:
    arch = ModelArch.from_dir(ds_dir)
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    del shapes["model.layers.2.mlp.experts.5.up_proj.weight"]
    params = {
        n: tuple(p.shape) for n, p in load_model(ds_dir, torch.float32, CPU).named_parameters()
    }
    with pytest.raises(ModelConfigError, match=r"experts\.5\.gate_proj"):
        plan(shapes, params, rules_for(arch.architecture))


def test_a_missing_expert_is_named(ds_dir, tensors) -> None:
    arch = ModelArch.from_dir(ds_dir)
    shapes = {n: tuple(t.shape) for n, t in tensors.items() if ".2.mlp.experts.7." not in n}
    model = load_model(ds_dir, torch.float32, CPU)
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    with pytest.raises(
        ModelConfigError, match=r"do not tile parameter model\.layers\.2\.mlp\.experts\."
    ):
        plan(shapes, params, rules_for(arch.architecture))


BLOCK = (48, 40)  # not dividing the weights' shapes: partial blocks at the edges


def quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's fp8 format: e4m3 values and one float32 scale per block (w = fp8 * scale)."""
    b0, b1 = BLOCK
    rows, cols = -(-w.shape[0] // b0), -(-w.shape[1] // b1)
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            block = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1]
            scale[i, j] = block.abs().max() / 448.0
            q[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = (block / scale[i, j]).to(q.dtype)
    return q, scale


def dequantise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    b0, b1 = BLOCK
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = q[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1].float()
            out[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = block * scale[i, j]
    return out


def test_fp8_block_quantised_weights_are_dequantised_on_load(ds_dir, tensors, tmp_path) -> None:
    fp8: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("_proj.weight") and t.dim() == 2:
            q, s = quantise(t)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            expected[name] = dequantise(q, s)
        else:
            fp8[name] = t
    qcfg = {"quant_method": "fp8", "weight_block_size": list(BLOCK), "fmt": "e4m3"}
    path = variant(ds_dir, tmp_path / "fp8", fp8, quantization_config=qcfg)
    params = dict(load_model(path, torch.float32, CPU).named_parameters())
    a = "model.layers.2.self_attn."
    assert torch.equal(params[a + "kv_b_proj.weight"], expected[a + "kv_b_proj.weight"])
    assert not torch.equal(params[a + "kv_b_proj.weight"], tensors[a + "kv_b_proj.weight"])
    x = "model.layers.2.mlp.experts."
    assert torch.equal(params[x + "gate_up_proj"][3, WIDTH:], expected[x + "3.up_proj.weight"])
    assert torch.equal(params[x + "down_proj"][7], expected[x + "7.down_proj.weight"])
    assert torch.equal(params[a + "kv_a_layernorm.weight"], tensors[a + "kv_a_layernorm.weight"])

    unscaled = {n: t for n, t in fp8.items() if n != a + "o_proj.weight_scale_inv"}
    path = variant(ds_dir, tmp_path / "unscaled", unscaled, quantization_config=qcfg)
    with pytest.raises(
        ModelConfigError, match=r"without a weight_scale_inv: .*2\.self_attn\.o_proj"
    ):
        load_model(path, torch.float32, CPU)


def test_mtp_layers_are_skipped_with_one_log_line(ds_dir, tensors, tmp_path, caplog) -> None:
    extra = dict(tensors)
    extra["model.layers.3.eh_proj.weight"] = torch.zeros(128, 256)
    extra["model.layers.3.self_attn.kv_a_layernorm.weight"] = torch.ones(32)
    path = variant(ds_dir, tmp_path / "mtp", extra, num_nextn_predict_layers=1)
    with caplog.at_level(logging.INFO, logger="pdserve.model.loader"):
        load_model(path, torch.float32, CPU)
    skipped = [r.getMessage() for r in caplog.records if "multi-token prediction" in r.getMessage()]
    assert skipped == [
        "skipping 2 tensors of 1 multi-token prediction layer(s) (model.layers.3.*): "
        "pdserve does not run MTP"
    ]
    path = variant(ds_dir, tmp_path / "no-mtp", extra, num_nextn_predict_layers=0)
    with pytest.raises(ModelConfigError, match=r"2 tensors match no parameter.*model\.layers\.3\."):
        load_model(path, torch.float32, CPU)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"architectures": ["DeepseekV2ForCausalLM"]}, "DeepseekV2ForCausalLM: DeepSeek-V2"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config .*awq"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax' not supported"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
        ({"q_lora_rank": None}, "'q_lora_rank' is missing"),
        ({"n_group": 3}, "n_routed_experts 8 must split into n_group 3"),
    ],
)
def test_what_cannot_run_is_refused_by_name(ds_dir, tmp_path, config, named) -> None:
    cfg = json.loads((ds_dir / "config.json").read_text())
    cfg.update(config)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ModelConfigError, match=named):
        ModelArch.from_hf_config(cfg)


def test_a_plain_q_proj_is_supported(ds_dir) -> None:
    cfg = json.loads((ds_dir / "config.json").read_text())
    arch = ModelArch.from_hf_config({**cfg, "q_lora_rank": None})
    assert arch.mla is not None and arch.mla.q_lora_rank is None
