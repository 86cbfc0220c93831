"""Loading HF directories: other Llama-family configs against HF, and clear refusals."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.model import loader, weight_map
from pdserve.model.config import ModelArch, ModelConfigError
from pdserve.model.loader import load_model
from pdserve.model.weight_map import Concat, Stack
from pdserve.protocol.sampling import SamplingParams
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
    assert len(out[0]) == 5 and eng.pool.layer(0)[0].dtype == torch.bfloat16


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


@pytest.mark.process
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


# ---------------------------------------------------------------- loading path


def rewrite(src, dst, tensors: dict[str, torch.Tensor], shards: int = 1):
    """A copy of model directory `src` whose weights are `tensors`, in `shards` files."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {n: t.contiguous().clone() for n, t in tensors.items()}  # own storage each
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(dst / "model.safetensors"))
        return dst
    index = {}
    for k in range(shards):
        part = {n: tensors[n] for n in names[k::shards]}
        save_file(part, str(dst / f"w{k}.safetensors"))
        index.update(dict.fromkeys(part, f"w{k}.safetensors"))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return dst


FUSED = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}


def as_parameters(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors by the model's parameter names: q/k/v and gate/up stacked (dim 0)."""
    out = dict(tensors)
    for name in list(tensors):
        for fused, parts in FUSED.items():
            module, _, _ = fused.partition(".")
            prefix, sep, rest = name.partition(f".{module}.{parts[0]}_proj.")
            if not sep:
                continue
            members = [f"{prefix}.{module}.{p}_proj.{rest}" for p in parts]
            out[f"{prefix}.{fused}.{rest}"] = torch.cat([tensors[m] for m in members])
            for m in members:
                del out[m]
    return out


def assert_loaded_exactly(model, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
    """Every parameter is its checkpoint tensor(s) cast to `dtype`, bit for bit (what the old
    float32-then-cast loader produced: tensor.to(dtype)); fused ones their parts, stacked."""
    params = dict(model.named_parameters())
    tensors = as_parameters(tensors)
    assert set(params) == set(tensors) - {"lm_head.weight"} or set(params) == set(tensors)
    for name, p in params.items():
        want = tensors[name].to(dtype)
        assert p.dtype == dtype and torch.equal(p.view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk", [loader.CHUNK_BYTES, 4096, 100])
def test_parameters_are_the_checkpoint_bit_for_bit(tiny_dir, monkeypatch, dtype, chunk):
    # 4096: several rows per read; 100: a row (1 KiB) larger than the buffer, which grows.
    monkeypatch.setattr(loader, "CHUNK_BYTES", chunk)
    model = load_model(tiny_dir, dtype, torch.device("cpu"))
    assert_loaded_exactly(model, load_file(str(tiny_dir / "model.safetensors")), dtype)
    assert model.inv_freq.dtype == torch.float32 and not model.inv_freq.is_meta


def test_sharded_bfloat16_checkpoint_into_float32(builtin_dir, tmp_path):
    src = builtin_dir("qwen2-tiny")
    tensors = {
        n: t.to(torch.bfloat16) for n, t in load_file(str(src / "model.safetensors")).items()
    }
    path = rewrite(src, tmp_path / "m", tensors, shards=3)
    model = load_model(path, torch.float32, torch.device("cpu"))
    assert_loaded_exactly(model, tensors, torch.float32)
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # qwen2-tiny is untied


def test_tied_embeddings_stay_tied(tiny_dir, tmp_path):
    model = load_model(tiny_dir, torch.bfloat16, torch.device("cpu"))
    assert model.arch.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())
    # Some exporters also write the tied head; that copy is not loaded a second time.
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    head = tensors["model.embed_tokens.weight"] + 1
    path = rewrite(tiny_dir, tmp_path / "m", {**tensors, "lm_head.weight": head})
    model = load_model(path, torch.float32, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_missing_extra_or_misshapen_tensor_is_named(tiny_dir, tmp_path):
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    missing = rewrite(tiny_dir, tmp_path / "a", {n: t for n, t in tensors.items() if n != name})
    with pytest.raises(ModelConfigError, match=rf"lacks 1 tensors for parameters {name}"):
        load_model(missing, torch.float32, torch.device("cpu"))
    part = "model.layers.1.mlp.up_proj.weight"  # one part of a fused parameter
    half = rewrite(tiny_dir, tmp_path / "a2", {n: t for n, t in tensors.items() if n != part})
    fused = r"gate_up_proj\.weight is fused from 2 tensors.*found model\.layers\.1\.mlp\.gate_proj"
    with pytest.raises(ModelConfigError, match=fused):
        load_model(half, torch.float32, torch.device("cpu"))
    extra = rewrite(
        tiny_dir, tmp_path / "b", {**tensors, "model.layers.1.mlp.extra": tensors[name]}
    )
    with pytest.raises(ModelConfigError, match=r"match no parameter.*model\.layers\.1\.mlp\.extra"):
        load_model(extra, torch.float32, torch.device("cpu"))
    wrong = rewrite(tiny_dir, tmp_path / "c", {**tensors, name: tensors[name][:, :-1]})
    with pytest.raises(ModelConfigError, match=rf"{name} has shape \(256, 703\).*\(256, 704\)"):
        load_model(wrong, torch.float32, torch.device("cpu"))
    # A tensor in two shards is not silently loaded twice.
    twice = rewrite(tiny_dir, tmp_path / "d", tensors, shards=2)
    save_file({name: tensors[name]}, str(twice / "w9.safetensors"))
    index = json.loads((twice / "model.safetensors.index.json").read_text())
    index["weight_map"]["other"] = "w9.safetensors"
    (twice / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelConfigError, match=rf"tensor {name} is in both"):
        load_model(twice, torch.float32, torch.device("cpu"))


def test_damaged_files_are_refused(tiny_dir, tmp_path):
    cut = edit_config(tiny_dir, tmp_path / "a")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelConfigError, match="does not fit its shape or the .*-byte file"):
        load_model(cut, torch.float32, torch.device("cpu"))
    garbage = edit_config(tiny_dir, tmp_path / "b")
    (garbage / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ModelConfigError, match="not a safetensors file"):
        load_model(garbage, torch.float32, torch.device("cpu"))


def test_concat_and_stack_rules_load_through_files(tiny_dir, tmp_path, monkeypatch):
    """Concat along dim 1 and Stack, end to end: o_proj stored as two column halves (strided
    destination slices) and the final norm as 0-d per-element tensors."""
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    split = {
        n: t for n, t in tensors.items() if not n.endswith(("o_proj.weight", "model.norm.weight"))
    }
    for i in range(4):
        o = tensors[f"model.layers.{i}.self_attn.o_proj.weight"]
        split[f"layers.{i}.o_left"], split[f"layers.{i}.o_right"] = o[:, :100], o[:, 100:]
    for e, v in enumerate(tensors["model.norm.weight"]):
        split[f"norm.{e}"] = v.clone()
    rules = (
        Concat(
            (r"layers\.(\d+)\.o_left", r"layers\.(\d+)\.o_right"),
            r"model.layers.\1.self_attn.o_proj.weight",
            dim=1,
        ),
        Stack(r"norm\.(?P<expert>\d+)", "model.norm.weight"),
        *weight_map.WEIGHT_MAP["LlamaForCausalLM"],  # q/k/v and gate/up fused, the rest as is
    )
    monkeypatch.setitem(weight_map.WEIGHT_MAP, "LlamaForCausalLM", rules)
    monkeypatch.setattr(loader, "CHUNK_BYTES", 4096)
    model = load_model(
        rewrite(tiny_dir, tmp_path / "m", split, shards=2), torch.float32, torch.device("cpu")
    )
    assert_loaded_exactly(model, tensors, torch.float32)
