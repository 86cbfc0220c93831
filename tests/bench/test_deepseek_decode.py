"""benchmarks/engine/deepseek_decode.py and the checkpoint it writes
(benchmarks/models/deepseek_checkpoint.py), on the CPU at the smoke scale: the checkpoint is
deterministic and loads (its fp8 twin dequantised to nearly the same weights), the warm
prefill starts a batch as one step of decodes, and the roofline's bytes are exactly what the
checkpoint's tensors and the pool's latent and index-K rows add up to. Timings not asserted."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.engine import decode_batch, deepseek_decode
from benchmarks.models import deepseek_checkpoint as ckpt
from pdserve.engine.offline import build_engine
from pdserve.engine.scheduler import Chunk
from pdserve.model.loader import load_model

CPU = torch.device("cpu")
# The model's parameters that the fp8 checkpoint stores in fp8 (gate and up fused here).
FP8_PARAM = re.compile(
    r".*(\.q_a_proj|\.q_b_proj|\.kv_a_proj_with_mqa|\.kv_b_proj|\.o_proj|gate_up_proj|down_proj"
    r"|\.wq_b|\.wk)(\.weight)?"
)


def test_checkpoint_is_deterministic_and_its_fp8_twin_loads_close(
    model_cache: Path, tmp_path: Path
) -> None:
    plain = ckpt.CheckpointSpec("v32", scale="smoke")
    a = ckpt.write_checkpoint(plain, tmp_path / "a", CPU)
    b = ckpt.write_checkpoint(plain, tmp_path / "b", CPU)
    shards = sorted(p.name for p in a.path.glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in b.path.glob("*.safetensors"))
    for name in shards:
        assert (a.path / name).read_bytes() == (b.path / name).read_bytes()
    assert ckpt.write_checkpoint(plain, a.path, CPU).reused  # complete: not written again
    fp8 = ckpt.write_checkpoint(ckpt.CheckpointSpec("v32", scale="smoke", fp8=True),
                                tmp_path / "fp8", CPU)  # fmt: skip
    cfg = json.loads((fp8.path / "config.json").read_text())
    assert cfg["quantization_config"] == ckpt.FP8_QUANT and cfg["num_hidden_layers"] == 3
    want = dict(load_model(a.path, torch.float32, CPU).named_parameters())
    got = dict(load_model(fp8.path, torch.float32, CPU, quantization="none").named_parameters())
    assert sorted(got) == sorted(want)
    quantised = 0
    for name, w in want.items():
        if FP8_PARAM.fullmatch(name):
            err = (got[name] - w).norm() / w.norm()
            assert 0 < err < 0.05, name  # e4m3: 3 mantissa bits, one scale per 128 x 128
            quantised += 1
        else:
            assert torch.equal(got[name], w), name
    assert quantised > 10


def test_warm_prefill_starts_the_batch_as_one_step_of_decodes(
    model_cache: Path, tmp_path: Path
) -> None:
    spec = ckpt.CheckpointSpec("v3", scale="smoke")
    path = ckpt.write_checkpoint(spec, tmp_path / spec.name, CPU).path
    engine = build_engine(path, max_batched_tokens=8192, max_running=3, max_model_len=128)
    steps: list[list[int]] = []
    forward = engine.runner.forward

    def recorded(chunks: list[Chunk], feed: Any = None) -> torch.Tensor:
        steps.append([c.length for c in chunks])
        return forward(chunks, feed)

    engine.runner.forward = recorded  # type: ignore[method-assign,assignment]
    ended: dict[str, str] = {}
    ids = decode_batch.prefill(engine, 3, 33, 8, ended, warm=True)
    # 32 tokens of each prompt in one step of chunks, then each request's last one: decodes
    assert steps == [[32, 32, 32], [1, 1, 1]] and not ended
    assert [c.length for c in decode_batch.decode_chunks(engine, ids)] == [1, 1, 1]
    with pytest.raises(ValueError, match="whole pages"):
        decode_batch.prefill(engine, 1, 40, 8, ended, warm=True)


def test_smoke_run_counts_the_roofline_exactly(
    model_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, root = tmp_path / "deepseek_decode.json", tmp_path / "root"
    root.mkdir()
    argv = ["--device", "cpu", "--dtype", "float32", "--scale", "smoke", "--batches", "1,3"]
    argv += ["--contexts", "16,48", "--steps", "1", "--warmup", "1", "--no-split"]
    argv += ["--root", str(root), "--out", str(out)]
    assert deepseek_decode.main(argv) == 0
    assert not any(root.iterdir())  # each checkpoint deleted after its model
    rows = json.loads(out.read_text())["rows"]
    got = [(r["name"], r["context"], r["batch"]) for r in rows]
    assert got == [
        (f"smoke-{a}-moe2", c, b) for a in ("v3", "v32") for c in (16, 48) for b in (1, 3)
    ]
    for r in rows:
        arch = r["name"].split("-")[1]
        cfg = ckpt.hf_config(ckpt.CheckpointSpec(arch, scale="smoke"))
        b, ctx = r["batch"], r["context"] + 2  # the prompt (context + 1) and the first token
        assert r["ctx"] == ctx
        h, top_k, e = cfg["hidden_size"], cfg["num_experts_per_tok"], cfg["n_routed_experts"]
        expert = 3 * cfg["moe_intermediate_size"] * h * 4
        assert len(r["distinct_experts"]) == 2
        assert all(top_k <= n <= min(e, b * top_k) for n in r["distinct_experts"])
        weights = 0
        for t in ckpt.tensor_specs(cfg, fp8=False):
            if ".mlp.experts." not in t.name and t.name != "model.embed_tokens.weight":
                weights += math.prod(t.shape) * 4  # float32 in memory
        weights += b * h * 4 + sum(r["distinct_experts"]) * expert  # embedding rows, experts
        weights += cfg["qk_rope_head_dim"] // 2 * 4  # the RoPE table (a buffer)
        latent_rows = min(ctx, cfg["index_topk"]) if arch == "v32" else ctx
        per_layer = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4 * (latent_rows + 1)
        if arch == "v32":
            per_layer += cfg["index_head_dim"] * 4 * (ctx + 1)
        kv = cfg["num_hidden_layers"] * b * per_layer
        assert r["bytes_per_step"] == weights + kv
        assert r["forward_ms"] > 0 and r["overlap_step_ms"] > 0 and r["roofline_ms"] > 0
    table = capsys.readouterr().out
    assert "| smoke-v32-moe2 | 3 | 50.0 |" in table


def test_contexts_must_be_whole_pages() -> None:
    with pytest.raises(SystemExit):
        deepseek_decode.parse_args(["--device", "cpu", "--contexts", "100"])
    args = deepseek_decode.parse_args(["--device", "cpu", "--contexts", "64"])
    assert isinstance(args, argparse.Namespace) and args.warm_prefill and not args.split
