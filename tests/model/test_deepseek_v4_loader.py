"""Loading DeepSeek-V4: `pdserve make-model deepseek-v4-tiny` then our loader gives HF's
logits; DeepSeek's own tensor names (its checkpoints' with or without the "model." prefix, and
the mix HF's save_pretrained writes back) load to the same parameters, MTP modules skipped;
in bf16 every parameter has the dtype HF gives it, and tid2eid stays int64."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve import cli
from pdserve.kvcache.v4_layout import v4_buffers, v4_state
from pdserve.model.deepseek_v4.kv import LocalSeqKV, LocalStepKV, Span
from pdserve.model.deepseek_v4.model import DeepseekV4ForCausalLM
from pdserve.model.loader import load_model

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def v4_dir(builtin_dir: Any) -> Path:
    return Path(builtin_dir("deepseek-v4-tiny"))


@pytest.fixture(scope="module")
def params(v4_dir: Path) -> dict[str, torch.Tensor]:
    return dict(load_model(v4_dir, torch.float32, CPU).named_parameters())


def _hf(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _logits(model: DeepseekV4ForCausalLM, ids: list[int]) -> torch.Tensor:
    v4 = model.v4
    kv = LocalSeqKV(
        {b.name: b for b in v4_buffers(v4, "float32", 128)},
        {s.name: s for s in v4_state(v4, "float32")},
    )
    with torch.no_grad():
        step = LocalStepKV([kv], [Span(0, len(ids), 0)])
        return model.compute_logits(
            model.forward_kv(torch.tensor(ids), torch.arange(len(ids)), step)
        )


def test_make_model_then_our_loader_gives_hfs_logits(v4_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "m"
    assert cli.main(["make-model", "deepseek-v4-tiny", "--out", str(out)]) == 0
    digest = [
        hashlib.sha256((p / "model.safetensors").read_bytes()).digest() for p in (out, v4_dir)
    ]
    assert digest[0] == digest[1]  # deterministic: the cached builtin's very bytes
    model = load_model(out, torch.float32, CPU)
    assert isinstance(model, DeepseekV4ForCausalLM)
    ids = torch.randint(3, 4000, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = _hf(out)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(model, ids), want, atol=1e-3, rtol=0)


def _deepseek_names(v4_dir: Path, out: Path, prefixed: bool, mtp: bool = False) -> Path:
    """The tiny model as DeepSeek names its tensors (HF's model built from the config writes
    them: save_pretrained reverses HF's conversion), with or without "model."."""
    hf = _hf(v4_dir)
    fresh = transformers.DeepseekV4ForCausalLM(hf.config)
    fresh.load_state_dict(hf.state_dict())
    fresh.save_pretrained(out)
    tensors = load_file(str(out / "model.safetensors"))
    assert "model.layers.1.attn.indexer.compressor.wkv.weight" in tensors
    assert "model.layers.3.ffn.experts.7.w3.weight" in tensors
    if not prefixed:
        top = {"embed_tokens.weight": "embed.weight"} | {
            f"hc_head.hc_{p}": f"hc_head_{p}" for p in ("fn", "base", "scale")
        }
        bare = {k: k.removeprefix("model.") for k in tensors}
        tensors = {top.get(bare[k], bare[k]): v for k, v in tensors.items()}
    if mtp:  # DeepSeek's multi-token prediction module, and the config that says so
        tensors["mtp.0.attn.wq_a.weight"] = torch.zeros(64, 128)
        tensors["mtp.0.enorm.weight"] = torch.zeros(128)
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(
    ("prefixed", "mtp"), [(True, False), (False, True)], ids=["model.-prefixed", "bare+mtp"]
)
def test_deepseek_tensor_names_load_as_hf_converts_them(
    v4_dir: Path, params: dict[str, torch.Tensor], tmp_path: Path, prefixed: bool, mtp: bool
) -> None:
    path = _deepseek_names(v4_dir, tmp_path / "ds", prefixed, mtp)
    got = dict(load_model(path, torch.float32, CPU).named_parameters())
    assert got.keys() == params.keys()
    assert all(torch.equal(got[k], params[k]) for k in params)
    hf = _hf(path).state_dict()  # HF reads these names as we do
    assert all(torch.equal(hf[k], params[k]) for k in params)


def test_what_hf_writes_back_loads(
    v4_dir: Path, params: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """Loaded from HF's own names, HF's save_pretrained writes a mix of both namings."""
    _hf(v4_dir).save_pretrained(tmp_path / "back")
    names = set(load_file(str(tmp_path / "back" / "model.safetensors")))
    assert "model.layers.0.self_attn.norm.weight" in names  # the mix
    got = dict(load_model(tmp_path / "back", torch.float32, CPU).named_parameters())
    assert all(torch.equal(got[k], params[k]) for k in params)


def test_in_bf16_every_parameter_has_hfs_dtype(v4_dir: Path) -> None:
    ours = dict(load_model(v4_dir, torch.bfloat16, CPU).named_parameters())
    hf = _hf(v4_dir, torch.bfloat16)
    theirs = {**dict(hf.named_parameters()), **dict(hf.named_buffers())}
    wrong = {k: (p.dtype, theirs[k].dtype) for k, p in ours.items() if p.dtype != theirs[k].dtype}
    assert not wrong
    assert {p.dtype for p in ours.values()} == {torch.bfloat16, torch.float32, torch.int64}
    table = load_file(str(v4_dir / "model.safetensors"))["model.layers.0.mlp.gate.tid2eid"]
    assert torch.equal(ours["model.layers.0.mlp.gate.tid2eid"], table)
    assert len({tuple(r) for r in table.tolist()}) > 40  # varied, distinct ids per token
    assert all(len(set(r)) == 2 for r in table.tolist())
