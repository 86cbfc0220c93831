"""benchmarks/engine/engine_load.py on the CPU at the tiny model: the closed loop serves every
prompt in full and measures inside its window. Its timings are not asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.engine import engine_load


@pytest.mark.parametrize("jitter_ms", [0.0, 5.0])
def test_tiny_closed_loop_serves_every_prompt_and_measures_one_window(
    model_cache: Path, tmp_path: Path, jitter_ms: float
) -> None:
    out = tmp_path / "load.json"
    argv = ["--device", "cpu", "--dtype", "float32", "--model", "builtin:tiny"]
    argv += ["--concurrency", "3", "--num-prompts", "16", "--warmup-prompts", "3"]
    argv += ["--input-len", "12", "--output-len", "5", "--jitter-ms", str(jitter_ms)]
    assert engine_load.main([*argv, "--out", str(out)]) == 0
    row = json.loads(out.read_text())["row"]
    assert row["total_tokens"] == 16 * 5  # every prompt served in full, the warm-up's too
    # The window (the last warm-up request's end to the last prompt's submission) holds the
    # first tokens of some requests and gaps of others, never more than were emitted.
    assert 1 <= row["requests"] < 16 and 1 <= row["itls"] <= 16 * 4
    assert row["window_s"] > 0 and row["output_tok_s"] > 0 and row["ticks"] > 0
    assert 0 <= row["prefill_tick_share"] <= 1
    assert row["tick_decode_ms"] > 0
    assert row["graph_replays"] is None  # no CUDA graphs on the CPU


def test_stub_forward_serves_the_load_with_no_model(tmp_path: Path) -> None:
    """--stub-forward: the tiny engine with its forward replaced by the batch build (the
    engine's host work alone), steps overlapped; every prompt still served in full."""
    out = tmp_path / "load.json"
    argv = ["--stub-forward", "--concurrency", "4", "--num-prompts", "24"]
    argv += ["--warmup-prompts", "4", "--input-len", "40", "--output-len", "6"]
    argv += ["--max-batched-tokens", "64"]
    assert engine_load.main([*argv, "--out", str(out)]) == 0
    row = json.loads(out.read_text())["row"]
    assert row["model"] == "stub"
    assert row["total_tokens"] == 24 * 6
    assert 0 < row["prefill_tick_share"] < 1  # 40-token prompts in 64-token steps: mixed
    assert row["decode_ticks_unwaited"] == 1.0  # nothing on a device to wait for
