"""Loading HF directories: other Llama-family configs against HF, and clear refusals."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from pdserve.engine.params import SamplingParams
from pdserve.model.config import ModelArch, ModelConfigError
from pdserve.model.loader import load_model
from tests.helpers import make_engine, run

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def save_hf(tmp_path, cls_name: str, **extra) -> object:
    cfg_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg_cls(**SMALL, **extra))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5 if p.dim() == 2 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize(
    "cls_name,extra",
    [
        ("MistralForCausalLM", {"sliding_window": 128}),
        ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("LlamaForCausalLM", {"attention_bias": True, "tie_word_embeddings": False}),
    ],
)
def test_other_configs_match_hf(tmp_path, cls_name, extra):
    hf = save_hf(tmp_path, cls_name, **extra)
    hf.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 16, 40)]
    engine = make_engine(tmp_path, page_size=8, chunk=16, max_model_len=128)
    ours = run(engine, prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    with torch.no_grad():
        ref = [
            hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    assert ours == ref
    if "sliding_window" in extra:
        assert engine.max_model_len == 128  # capped at the window: attention stays exact


def test_bfloat16_loads_and_generates(tiny_dir):
    model = load_model(tiny_dir, torch.bfloat16, torch.device("cpu"))
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32
    from pdserve.engine.offline import build_engine

    eng = build_engine(tiny_dir, dtype="bfloat16", kv_budget_mb=8)
    out = run(eng, [[5, 6, 7, 8]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(out[0]) == 5 and eng.pool.data.dtype == torch.bfloat16


def edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_refusals_name_the_problem(tiny_dir, tmp_path):
    with pytest.raises(ModelConfigError, match="config.json is missing"):
        ModelArch.from_dir(tmp_path)
    bad_arch = edit_config(tiny_dir, tmp_path / "a", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelConfigError, match="GPT2LMHeadModel.*not supported"):
        ModelArch.from_dir(bad_arch)
    bad_rope = edit_config(
        tiny_dir, tmp_path / "b", rope_scaling={"rope_type": "yarn"}, rope_parameters=None
    )
    with pytest.raises(ModelConfigError, match="yarn"):
        ModelArch.from_dir(bad_rope)
    no_weights = edit_config(tiny_dir, tmp_path / "c")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelConfigError, match="no weights found"):
        load_model(no_weights, torch.float32, torch.device("cpu"))
    wrong_shape = edit_config(tiny_dir, tmp_path / "d", intermediate_size=64)
    with pytest.raises(ModelConfigError, match="shape"):
        load_model(wrong_shape, torch.float32, torch.device("cpu"))


def test_cli_refuses_a_non_model_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    r = subprocess.run(
        [sys.executable, "-m", "pdserve", "serve", "--model", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "config.json is missing" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "pdserve", "serve", "--model", "builtin:nope", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "tiny" in r.stderr
