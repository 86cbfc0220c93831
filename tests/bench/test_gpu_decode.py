"""benchmarks/engine/gpu_decode.py on the CPU at the tiny model: it drives the engine it measures
(prefill, a planned decode step, ticks, aborts) and counts the roofline's bytes and FLOPs
exactly. Its timings are not asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.engine import gpu_decode
from pdserve.model.builtin_specs import builtin_spec


def test_tiny_run_counts_the_roofline_exactly(
    model_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gpu_decode.json"
    argv = ["--device", "cpu", "--dtype", "float32", "--models", "tiny", "--batches", "1,3"]
    argv += ["--ctx", "20", "--steps", "2", "--warmup", "1", "--skip-hf", "--out", str(out)]
    assert gpu_decode.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["batch"]) for r in rows] == [("tiny", 1), ("tiny", 3)]
    s = builtin_spec("tiny")
    h, q, kv, ff = (
        s.hidden_size,
        s.num_heads * s.head_dim,
        s.num_kv_heads * s.head_dim,
        s.intermediate_size,
    )
    layer_matmuls = h * (2 * q + 2 * kv) + 3 * h * ff
    matmuls = s.num_layers * layer_matmuls + s.vocab_size * h  # the tied head once
    weight_bytes = 4 * (matmuls + s.num_layers * 2 * h + h)  # + the RMSNorm weights
    for r in rows:
        b = r["batch"]
        assert r["ctx"] == 21  # the prompt and the first token: the step decodes token 21
        kv_bytes = b * (21 + 1) * s.num_layers * 2 * kv * 4  # 21 read, 1 written
        assert r["bytes_per_step"] == weight_bytes + kv_bytes
        attn = 4 * b * 21 * s.num_layers * q
        assert r["flops_per_step"] == 2 * b * matmuls + attn
        assert r["forward_ms"] > 0 and r["engine_step_ms"] > 0 and r["roofline_ms"] > 0
    table = capsys.readouterr().out.strip().splitlines()
    assert len(table) == 4 and table[2].startswith("| tiny | 1 | 21.0 |")
