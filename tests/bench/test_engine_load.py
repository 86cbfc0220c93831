"""benchmarks/engine_load.py on the CPU at the tiny model: the closed loop serves every prompt,
counts only the measured requests' tokens, and labels the ticks that carried a prefill chunk.
Its timings are not asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import engine_load


@pytest.mark.parametrize("jitter_ms", [0.0, 5.0])
def test_tiny_closed_loop_counts_every_measured_token(
    model_cache: Path, tmp_path: Path, jitter_ms: float
) -> None:
    out = tmp_path / "load.json"
    argv = ["--device", "cpu", "--dtype", "float32", "--model", "builtin:tiny"]
    argv += ["--concurrency", "3", "--num-prompts", "10", "--warmup-prompts", "4"]
    argv += ["--input-len", "12", "--output-len", "5", "--jitter-ms", str(jitter_ms)]
    assert engine_load.main([*argv, "--out", str(out)]) == 0
    row = json.loads(out.read_text())["row"]
    assert row["requests"] == 6
    assert row["output_tokens"] == 6 * 5  # only requests submitted after the warm-up ones
    assert row["itls"] == 6 * 4  # the first token of each is its TTFT
    assert 0 < row["prefill_tick_share"] < 1  # the replacements' prompts, between decodes
    assert row["tick_prefill_ms"] > 0 and row["tick_decode_ms"] > 0
    assert row["graph_replays"] is None  # no CUDA graphs on the CPU
