"""fp8 weights kept fp8 (`--quantization`, model/fp8_weights.py): which parameters the loader
keeps, their scales' placement, and greedy parity of the engine's fp8 path with its definition.

The oracle: HF transformers' DeepSeek-V3 on the dequantised weights, each kept projection's
input quantised per 128-value group and dequantised again before its product (DeepSeek's fp8
inference, written as fake quantisation; for a "scale_fmt": "ue8m0" checkpoint, V3.1's and
V3.2's, with the group scales rounded up to powers of two). pdserve multiplies the e4m3 values
with scales applied per block: the same values, summed in another order.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.config import ModelSpec
from pdserve.engine.offline import build_engine, generate
from pdserve.kernels import fp8_blocks
from pdserve.model.builtin_weights import FP8_QUANTIZATION_CONFIG, fp8_checkpoint
from pdserve.model.config import ModelConfigError
from pdserve.model.fp8_linear import Fp8Linear
from pdserve.model.loader import load_model
from pdserve.model.moe import Experts
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams

CPU = torch.device("cpu")
LENGTHS = [1, 5, 12, 17, 30, 41]
NEW_TOKENS = 12
# The projections DeepSeek quantises and pdserve keeps fp8 (kv_b_proj is dequantised).
KEPT = (
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_up_proj", "down_proj",
    "indexer.wq_b", "indexer.wk",
)  # fmt: skip


@pytest.fixture(scope="module")
def fp8_dir(builtin_dir) -> Path:
    return builtin_dir("deepseek-v3-fp8-tiny")


def fp8_copy(src: Path, dst: Path) -> Path:
    """A built-in (one safetensors file) in DeepSeek's fp8 checkpoint format."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    out = fp8_checkpoint(load_file(str(src / "model.safetensors")))
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = FP8_QUANTIZATION_CONFIG
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def v32_fp8_dir(builtin_dir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deepseek-v32-tiny in fp8: its indexer's wq_b and wk kept fp8 too; its experts (64 rows
    wide, so up starts inside gate's block) and dense MLP stay dequantised."""
    return fp8_copy(builtin_dir("deepseek-v32-tiny"), tmp_path_factory.mktemp("v32") / "fp8")


@pytest.fixture(scope="module")
def ue8m0_dir(fp8_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deepseek-v3-fp8-tiny as a V3.1-style checkpoint: "scale_fmt": "ue8m0". Its weight
    scales stay the float32 ones (DeepSeek's are powers of two too, which the loader does not
    ask of them); what changes is how the activations are quantised."""
    dst = tmp_path_factory.mktemp("ue8m0") / "fp8"
    shutil.copytree(fp8_dir, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {**cfg["quantization_config"], "scale_fmt": "ue8m0"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def dequantised_copy(src: Path, dst: Path) -> Path:
    """`src` with every fp8 weight dequantised to float32 and no quantization_config."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    stored = load_file(str(src / "model.safetensors"))
    out = {
        n: fp8_blocks.dequantize_weight(t, stored[n + "_scale_inv"])
        if t.dtype == fp8_blocks.FP8_DTYPE
        else t
        for n, t in stored.items()
        if not n.endswith("_scale_inv")
    }
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_every_projection_but_kv_b_stays_fp8(fp8_dir: Path) -> None:
    model = load_model(fp8_dir, torch.float32, CPU, quantization="fp8")
    params = dict(model.named_parameters())
    kept = {n for n, p in params.items() if p.dtype == fp8_blocks.FP8_DTYPE}
    attention = [f"model.layers.{i}.self_attn.{k}.weight" for i in range(3) for k in KEPT[:4]]
    mlps = [f"model.layers.0.mlp.{k}.weight" for k in ("gate_up_proj", "down_proj")] + [
        f"model.layers.{i}.mlp.{part}"
        for i in (1, 2)
        for part in ("experts.gate_up_proj", "experts.down_proj",
                     "shared_experts.gate_up_proj.weight", "shared_experts.down_proj.weight")
    ]  # fmt: skip
    assert kept == set(attention + mlps)
    for name in kept:
        assert params[name + "_scale_inv"].dtype == torch.float32
    for i in range(3):
        a = f"model.layers.{i}.self_attn."
        assert params[a + "kv_b_proj.weight"].dtype == torch.float32
        assert isinstance(model.get_submodule(a + "o_proj"), Fp8Linear)
    assert params["lm_head.weight"].dtype == torch.float32


def test_kept_weights_and_stacked_scales_equal_the_checkpoint(fp8_dir: Path) -> None:
    stored = load_file(str(fp8_dir / "model.safetensors"))
    params = dict(load_model(fp8_dir, torch.float32, CPU, quantization="fp8").named_parameters())
    plain = dict(load_model(fp8_dir, torch.float32, CPU, quantization="none").named_parameters())
    e = "model.layers.2.mlp.experts"
    for x in range(8):  # expert x: its gate then up scales, stacked, rows in 128-row blocks
        src = f"{e}.{x}."
        want = torch.cat(
            [stored[src + "gate_proj.weight_scale_inv"], stored[src + "up_proj.weight_scale_inv"]]
        )
        assert torch.equal(params[f"{e}.gate_up_proj_scale_inv"][x], want)
        assert torch.equal(params[f"{e}.down_proj"][x], stored[src + "down_proj.weight"])
    for name, p in params.items():
        if p.dtype != fp8_blocks.FP8_DTYPE:
            continue
        scale = params[name + "_scale_inv"]
        whole = (
            torch.stack([fp8_blocks.dequantize_weight(w, s) for w, s in zip(p, scale, strict=True)])
            if p.dim() == 3
            else fp8_blocks.dequantize_weight(p, scale)
        )
        assert torch.equal(whole, plain[name]), name  # the dequantised load's bits


def test_a_module_whose_parts_straddle_blocks_stays_dequantised(v32_fp8_dir: Path) -> None:
    """The stacked experts keep both weights fp8 or neither: their up rows start inside the
    gate's block, so gate_up cannot be kept, and down (which alone could be) is not."""
    params = dict(
        load_model(v32_fp8_dir, torch.float32, CPU, quantization="fp8").named_parameters()
    )
    e = "model.layers.1.mlp.experts."
    assert params[e + "gate_up_proj"].dtype == params[e + "down_proj"].dtype == torch.float32
    assert e + "down_proj_scale_inv" not in params
    a = "model.layers.1.self_attn."
    for kept in ("q_a_proj", "o_proj", "indexer.wq_b", "indexer.wk"):
        assert params[a + kept + ".weight"].dtype == fp8_blocks.FP8_DTYPE, kept
    assert params[a + "indexer.weights_proj.weight"].dtype == torch.float32


@pytest.mark.parametrize("ue8m0", [False, True])
def test_ue8m0_checkpoints_quantise_activations_with_power_of_two_scales(
    ue8m0: bool, fp8_dir: Path, ue8m0_dir: Path
) -> None:
    """Every product kept fp8 is flagged: each Fp8Linear and the fp8 experts, pow2 exactly
    when the checkpoint says "scale_fmt": "ue8m0"."""
    model = load_model(ue8m0_dir if ue8m0 else fp8_dir, torch.float32, CPU, quantization="fp8")
    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert len(linears) == 4 * 3 + 2 + 2 * 2 and len(experts) == 2  # as kept above
    assert all(e.down_proj.dtype == fp8_blocks.FP8_DTYPE for e in experts)
    assert [m.pow2_scales for m in linears] == [ue8m0] * len(linears)
    assert [e.fp8_pow2_scales for e in experts] == [ue8m0] * len(experts)
    assert f"pow2_scales={ue8m0}" in repr(linears[0])


def test_quantization_choices_are_checked(fp8_dir: Path, builtin_dir, tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="not block-quantised"):
        load_model(builtin_dir("deepseek-v3-tiny"), torch.float32, CPU, quantization="fp8")
    with pytest.raises(ModelConfigError, match="DeepSeek-V3 and V3.2 only"):
        load_model(fp8_copy(builtin_dir("tiny"), tmp_path / "t"), torch.float32, CPU, None, "fp8")
    # auto on a CPU: no fp8 kernel there, so the checkpoint is dequantised
    auto = load_model(fp8_dir, torch.float32, CPU)
    assert all(p.dtype == torch.float32 for p in auto.parameters())
    with pytest.raises(ModelConfigError, match="--quantization must be one of"):
        load_model(fp8_dir, torch.float32, CPU, quantization="int4")
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelSpec("p", "n", quantization="fp4")
    plain = load_model(builtin_dir("deepseek-v3-tiny"), torch.float32, CPU)  # auto: nothing kept
    assert all(p.dtype == torch.float32 for p in plain.parameters())


def fake_quant(x: torch.Tensor, pow2: bool) -> torch.Tensor:
    """x quantised per 128-value group of its last dim and dequantised: DeepSeek's activations
    (`pow2`: their scales rounded up to powers of two, as for a ue8m0 checkpoint)."""
    flat = x.reshape(-1, x.shape[-1])
    q, s = fp8_blocks.act_quant(flat, pow2=pow2)
    k = flat.shape[1]
    return (q.float() * s.repeat_interleave(fp8_blocks.BLOCK, 1)[:, :k]).view(x.shape).to(x.dtype)


def kept_in_hf(path: Path) -> set[str]:
    """HF's names of the weights pdserve keeps fp8 for this checkpoint (HF keeps a dense
    MLP's gate and up apart; the rest share pdserve's names)."""
    model = load_model(path, torch.float32, CPU, quantization="fp8")
    kept = {n for n, p in model.named_parameters() if p.dtype == fp8_blocks.FP8_DTYPE}
    split = {n.replace("gate_up_proj.", f"{h}_proj.") for n in kept for h in ("gate", "up")}
    return {n for n in kept if not n.endswith("gate_up_proj.weight")} | {
        n for n in split if n.endswith(("gate_proj.weight", "up_proj.weight"))
    }


def hf_fp8_logprobs(
    path: Path, prompts: list[list[int]], kept: set[str], pow2: bool = False
) -> torch.Tensor:
    """HF's log-probability of each prompt's next token [P, T - 1], float32, the input of each
    product with a weight named in `kept` fake-quantised (with power-of-two scales: `pow2`):
    F.linear quantises it (a weight is known by its storage: an expert's weight is a view of
    the stacked one)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.float32,
        experts_implementation="eager",  # its loop calls F.linear
    )
    named = model.named_parameters()
    quantised = {p.untyped_storage().data_ptr() for n, p in named if n in kept}
    linear = torch.nn.functional.linear

    def fp8_linear(x, w, b=None):  # type: ignore[no-untyped-def]
        if w.untyped_storage().data_ptr() in quantised:
            x = fake_quant(x, pow2)
        return linear(x, w, b)

    ids = torch.tensor(prompts)
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(torch.nn.functional, "linear", fp8_linear)
        logprobs = model(ids).logits.float().log_softmax(-1)  # [P, T, V]
    return logprobs[:, :-1].gather(2, ids[:, 1:, None])[..., 0]


def engine_logprobs(path: Path, prompts: list[list[int]], quantization: str) -> torch.Tensor:
    """pdserve's prompt logprobs of the same tokens [P, T - 1] (chunked prefill, pages of 4)."""
    engine = build_engine(
        path, quantization=quantization, page_size=4, max_batched_tokens=12, kv_budget_mb=4.0
    )
    got: dict[int, list[float]] = {}
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    for i, p in enumerate(prompts):

        def sink(o: RequestOutput, i: int = i) -> None:
            if o.prompt_logprobs:
                got[i] = [t.logprob for t in o.prompt_logprobs]

        engine.submit(f"r{i}", p, params, sink)
    deadline = time.monotonic() + 120
    while len(got) < len(prompts) and time.monotonic() < deadline:
        engine.tick()
    return torch.tensor([got[i] for i in range(len(prompts))])


@pytest.mark.parametrize("which", ["v3", "v32", "v3-ue8m0"])
def test_the_fp8_path_equals_its_definition(
    which: str, fp8_dir: Path, v32_fp8_dir: Path, ue8m0_dir: Path, tmp_path: Path
) -> None:
    """fp8 rounding is a step function: where the two sides' float32 inputs differ by an ulp
    across a rounding boundary, one value moves by an e4m3 step, and a routing choice or a
    later position may follow, chaotically per prompt (hence eight prompts, so that one
    prompt's early flip cannot sink the share). So most positions, not all, agree to float32
    noise; the dequantised path agrees at none (the quantisation is really applied), and
    neither does the definition with the other scale rule (plain vs power-of-two: the rule
    is the checkpoint's)."""
    # V3.2: prompts past its top-k of 12; ue8m0: V3-tiny as V3.1 stores it
    path = {"v3": fp8_dir, "v32": v32_fp8_dir, "v3-ue8m0": ue8m0_dir}[which]
    pow2 = which.endswith("ue8m0")
    g = torch.Generator().manual_seed(8)
    prompts = torch.randint(3, 4000, (8, 40), generator=g).tolist()
    dequantised = dequantised_copy(path, tmp_path / "deq")
    kept = kept_in_hf(path)
    want = hf_fp8_logprobs(dequantised, prompts, kept, pow2)
    fp8 = engine_logprobs(path, prompts, "fp8")
    ours = (fp8 - want).abs()
    none = engine_logprobs(path, prompts, "none")
    plain = (none - want).abs()
    other_rule = (fp8 - hf_fp8_logprobs(dequantised, prompts, kept, not pow2)).abs()
    assert (ours < 1e-3).float().mean() >= 0.5, ours
    assert ours.median() < 1e-4
    assert (plain < 1e-3).float().mean() <= 0.05, plain
    assert (other_rule < 1e-3).float().mean() <= 0.05, other_rule
    # and the dequantised path is HF's plain model, to float32 noise
    exact = hf_fp8_logprobs(dequantised, prompts, set())
    assert (none - exact).abs().max() < 1e-3


def test_fp8_greedy_decoding_runs_chunked_or_not(fp8_dir: Path) -> None:
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in LENGTHS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    kw: dict = dict(quantization="fp8", kv_budget_mb=4.0)
    chunked = build_engine(fp8_dir, page_size=4, max_batched_tokens=12, **kw)
    whole = build_engine(fp8_dir, **kw)
    out = generate(chunked, prompts, params)
    assert out == generate(whole, prompts, params)
    assert [len(o) for o in out] == [NEW_TOKENS] * len(prompts)


def test_the_quantization_flag_reaches_the_model_spec_and_launch_passes_it_on(
    fp8_dir: Path,
) -> None:
    import argparse

    from pdserve import launch
    from pdserve.engine_flags import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--model", str(fp8_dir), "--device", "cpu", "--quantization", "none"])
    assert engine_config(args).model.quantization == "none"
    argv = launch.engine_flags(args)  # what `pdserve launch` gives each worker
    assert argv[argv.index("--quantization") + 1] == "none"
    assert engine_config(p.parse_args(["--model", str(fp8_dir)])).model.quantization == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "int4"])
