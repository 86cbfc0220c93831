"""DeepSeek-V4-Flash's quantised checkpoints load dequantised: deepseek-v4-tiny written as Flash
ships (tests/model/v4_flash_export.py: fp8 e4m3 linears with E8M0 block scales, fp4 e2m1
routed experts, DeepSeek's names and config) gives every weight bit for bit as transformers
loads it from the same directory (FineGrainedFP8Config(dequantize=True), on CPU), and in
bfloat16 that weight rounded once; on it our model picks HF's greedy tokens in float32; a
malformed checkpoint is refused by a message naming the tensor, a bad config by the field."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.kvcache.v4_layout import v4_buffers, v4_state
from pdserve.model.config import ModelArch, ModelConfigError
from pdserve.model.deepseek_v4.kv import LocalSeqKV, LocalStepKV, Span
from pdserve.model.deepseek_v4.model import DeepseekV4ForCausalLM
from pdserve.model.loader import load_model
from tests.model.v4_flash_export import write_v4_flash

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
PROMPT_LEN, NEW_TOKENS = 140, 12  # past the 128-token HCA window: every path runs


@pytest.fixture(scope="module")
def v4_dir(builtin_dir: Any) -> Path:
    return Path(builtin_dir("deepseek-v4-tiny"))


@pytest.fixture(scope="module")
def flash_dir(v4_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_v4_flash(v4_dir, tmp_path_factory.mktemp("v4-flash"))


@pytest.fixture(scope="module")
def hf(flash_dir: Path) -> Any:
    """transformers' own load of the quantised directory, dequantised to float32."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        flash_dir,
        dtype=torch.float32,
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True),
        output_loading_info=True,
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


@pytest.fixture(scope="module")
def ours(flash_dir: Path) -> DeepseekV4ForCausalLM:
    model = load_model(flash_dir, torch.float32, CPU)
    assert isinstance(model, DeepseekV4ForCausalLM)
    return model


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def test_every_weight_is_hfs_dequantised_weight_bit_for_bit(
    ours: DeepseekV4ForCausalLM, hf: Any, v4_dir: Path
) -> None:
    theirs = hf.state_dict()
    params = dict(ours.named_parameters())
    assert params.keys() <= theirs.keys()
    differ = [k for k, p in params.items() if not torch.equal(bits(p), bits(theirs[k]))]
    assert not differ
    # ... and they are the quantised weights: near the originals, not them
    original = load_file(str(v4_dir / "model.safetensors"))
    x, a = "model.layers.2.mlp.experts.", "model.layers.1.self_attn."
    for name, tol in (
        (x + "gate_up_proj", 0.25),  # fp4: 3 bits, steps up to a third of the block's amax
        (x + "down_proj", 0.25),
        (a + "compressor.indexer.q_b_proj.weight", 1 / 16),  # fp8 e4m3: 3 mantissa bits
        (a + "o_b_proj.weight", 1 / 16),
        (a + "compressor.kv_proj.weight", 1 / 128),  # bf16, no scale
    ):
        err = (params[name] - original[name]).abs().max() / original[name].abs().max()
        assert 0 < err < tol, (name, err)


def test_in_bfloat16_each_weight_is_the_float32_one_rounded_once(
    ours: DeepseekV4ForCausalLM, flash_dir: Path
) -> None:
    f32 = dict(ours.named_parameters())
    for name, p in load_model(flash_dir, torch.bfloat16, CPU).named_parameters():
        assert torch.equal(p, f32[name].to(p.dtype)), name


def test_experts_stored_as_safetensors_f4_load_as_the_int8_ones(
    ours: DeepseekV4ForCausalLM, flash_dir: Path, tmp_path: Path
) -> None:
    """The same bytes typed F4 (torch's float4_e2m1fn_x2: the header counts values, not bytes)."""

    def retype(t: Tensors) -> None:
        for n, v in t.items():
            if v.dtype == torch.int8:
                t[n] = v.view(torch.float4_e2m1fn_x2)

    got = load_model(_broken(flash_dir, tmp_path / "f4", retype), torch.float32, CPU)
    want = dict(ours.named_parameters())
    assert all(torch.equal(bits(p), bits(want[n])) for n, p in got.named_parameters())


def _greedy(model: DeepseekV4ForCausalLM, prompt: list[int]) -> list[int]:
    """One-shot prefill, then one token a step."""
    v4 = model.v4
    kv = LocalSeqKV(
        {b.name: b for b in v4_buffers(v4, "float32", 128)},
        {s.name: s for s in v4_state(v4, "float32")},
    )
    ids, start, new = [], 0, prompt
    with torch.no_grad():
        while len(ids) < NEW_TOKENS:
            step = LocalStepKV([kv], [Span(0, len(new), start)])
            positions = torch.arange(start, start + len(new))
            hidden = model.forward_kv(torch.tensor(new), positions, step)
            ids.append(int(model.compute_logits(hidden[-1:])[0].argmax()))
            start, new = start + len(new), ids[-1:]
    return ids


def test_greedy_tokens_are_hfs_on_the_same_weights(ours: DeepseekV4ForCausalLM, hf: Any) -> None:
    g = torch.Generator().manual_seed(40)
    prompt = torch.randint(3, 4000, (PROMPT_LEN,), generator=g).tolist()
    x = torch.tensor([prompt])
    with torch.no_grad():
        want = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )[0, PROMPT_LEN:].tolist()
    assert _greedy(ours, prompt) == want
    assert len(set(want)) > 1


# ---------------------------------------------------------------- malformed checkpoints

Tensors = dict[str, torch.Tensor]


def _broken(flash_dir: Path, out: Path, edit: Callable[[Tensors], None], **config: Any) -> Path:
    """The Flash checkpoint in one file, `edit` applied to its tensors and `config` (a None
    value removes the key) to its config.json."""
    tensors: Tensors = {}
    for shard in sorted(flash_dir.glob("*.safetensors")):
        tensors |= load_file(str(shard))
    edit(tensors)
    out.mkdir()
    tensors = {n: t.contiguous() for n, t in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((flash_dir / "config.json").read_text()) | config
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return out


def _drop(name: str) -> Callable[[Tensors], None]:
    def edit(t: Tensors) -> None:
        del t[name]

    return edit


def _set(name: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Tensors], None]:
    def edit(t: Tensors) -> None:
        t[name] = value(t[name])

    return edit


def _fp4_narrowed(t: Tensors) -> None:
    """An expert's w2 half as wide as the config says, its scale consistent with that."""
    w = "layers.3.ffn.experts.1.w2."
    t[w + "weight"], t[w + "scale"] = t[w + "weight"][:, :16], t[w + "scale"][:, :1]


def _nan_scale(s: torch.Tensor) -> torch.Tensor:
    s = s.view(torch.uint8).clone()
    s[0, 0] = 255
    return s.view(torch.float8_e8m0fnu)


BROKEN: list[tuple[str, Callable[[Tensors], None], dict[str, Any], str]] = [
    (
        "scale-without-weight",
        _drop("layers.2.attn.wq_a.weight"),
        {},
        r"scale layers\.2\.attn\.wq_a\.scale has no weight layers\.2\.attn\.wq_a\.weight",
    ),
    (
        "fp8-weight-without-scale",
        _drop("layers.3.ffn.shared_experts.w2.scale"),
        {},
        r"without a weight_scale_inv: layers\.3\.ffn\.shared_experts\.w2\.weight \(",
    ),
    (
        "fp4-weight-without-scale",
        _drop("layers.4.ffn.experts.5.w1.scale"),
        {},
        r"without a weight_scale_inv: layers\.4\.ffn\.experts\.5\.w1\.weight \(",
    ),
    (
        "fp8-scale-shape",
        _set("layers.1.attn.indexer.wq_b.scale", lambda s: s[:2]),
        {},
        r"scale layers\.1\.attn\.indexer\.wq_b\.scale is torch\.float8_e8m0fnu \(2, 1\); "
        r"weight layers\.1\.attn\.indexer\.wq_b\.weight \(fp8, \[512, 64\] in blocks of "
        r"\(128, 128\)\) needs .*\(4, 1\)",
    ),
    (
        "fp4-scale-shape",
        _set("layers.2.ffn.experts.3.w2.scale", lambda s: s[:, :1]),
        {},
        r"scale layers\.2\.ffn\.experts\.3\.w2\.scale is torch\.float8_e8m0fnu \(128, 1\); "
        r"weight layers\.2\.ffn\.experts\.3\.w2\.weight \(fp4, \[128, 64\] in blocks of "
        r"\(1, 32\)\) needs .*\(128, 2\)",
    ),
    (
        "fp4-scale-dtype",
        _set("layers.2.ffn.experts.0.w1.scale", lambda s: s.float()),
        {},
        r"scale layers\.2\.ffn\.experts\.0\.w1\.scale is torch\.float32 \(64, 4\)",
    ),
    (
        "fp4-data-shape",
        _fp4_narrowed,
        {},
        r"tensor layers\.3\.ffn\.experts\.1\.w2\.weight has shape \(128, 32\) \(fp4 stored as "
        r"torch\.int8 \(128, 16\)\), but parameter model\.layers\.3\.mlp\.experts\.down_proj "
        r"needs \(128, 64\)",
    ),
    (
        "nan-scale",
        _set("layers.2.attn.wo_b.scale", _nan_scale),
        {},
        r"the scale of layers\.2\.attn\.wo_b\.weight holds E8M0 byte 255",
    ),
    (
        "fp4-data-but-fp8-experts",
        lambda t: None,
        {"expert_dtype": "fp8"},
        r"layers\.0\.ffn\.experts\.0\.w1\.weight is torch\.int8 with a scale \(fp4 data\), but "
        r"config\.json's expert_dtype is 'fp8'",
    ),
    (
        "scales-without-quantization_config",
        lambda t: None,
        {"quantization_config": None},
        r"layers\.0\.attn\.wkv\.scale and \d+ more scales, but config\.json has no fp8 "
        "quantization_config",
    ),
]


@pytest.mark.parametrize(
    ("edit", "config", "named"), [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN]
)
def test_a_malformed_checkpoint_is_refused_naming_the_tensor(
    flash_dir: Path,
    tmp_path: Path,
    edit: Callable[[Tensors], None],
    config: dict[str, Any],
    named: str,
) -> None:
    path = _broken(flash_dir, tmp_path / "broken", edit, **config)
    with pytest.raises(ModelConfigError, match=named):
        load_model(path, torch.float32, CPU)


@pytest.mark.parametrize(
    ("quant", "top", "named"),
    [
        ({"quant_method": "mxfp4"}, {}, r"quantization_config \{.*'mxfp4'.* not supported"),
        ({"fmt": "e5m2"}, {}, r"quantization_config fmt 'e5m2' not supported"),
        ({"scale_fmt": "ue4m3"}, {}, r"scale_fmt 'ue4m3' not supported; supported: \['float'"),
        ({}, {"expert_dtype": "fp6"}, r"expert_dtype 'fp6' not supported; supported: \['fp8'"),
        ({"expert_dtype": "fp8"}, {}, r"expert_dtype 'fp4' and quantization_config's 'fp8'"),
        ({"activation_scheme": "static"}, {}, r"activation_scheme 'static' not supported"),
        ({"weight_block_size": [128, 0]}, {}, r"weight_block_size must be two ints > 0"),
    ],
)
def test_a_quantization_config_we_cannot_dequantise_is_refused_by_field(
    flash_dir: Path, quant: dict[str, Any], top: dict[str, Any], named: str
) -> None:
    cfg = json.loads((flash_dir / "config.json").read_text())
    cfg = cfg | top | {"quantization_config": cfg["quantization_config"] | quant}
    with pytest.raises(ModelConfigError, match=named):
        ModelArch.from_hf_config(cfg)
