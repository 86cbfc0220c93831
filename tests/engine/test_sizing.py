"""The limits left to engine/sizing.py: chosen from the model and the device, each said."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pdserve.config import AUTO_LIMITS, EngineConfig, ModelSpec
from pdserve.engine import sizing
from pdserve.engine.sizing import DeviceMemory
from pdserve.engine_flags import add_engine_args, engine_config
from pdserve.model.config import ModelArch
from pdserve.runtime.launcher import LaunchConfig, worker_argvs

GiB = 2**30


@pytest.fixture
def arch(tiny_dir) -> ModelArch:
    """The tiny model's shape with a 1B-class vocabulary and an 8k context."""
    tiny = ModelArch.from_dir(tiny_dir)
    return dataclasses.replace(tiny, max_position_embeddings=8192, vocab_size=128_256)


def cfg(auto: frozenset[str] = AUTO_LIMITS) -> EngineConfig:
    return EngineConfig(ModelSpec(path="/m", name="m"), auto=auto)


def test_a_cpu_keeps_the_small_defaults_and_takes_the_models_context(arch):
    out, said = sizing.resolve(cfg(), arch, None)
    s = out.scheduler
    assert (s.max_running, s.max_batched_tokens, s.max_model_len) == (64, 512, 8192)
    assert out.cache.kv_budget_bytes == sizing.CPU_KV_BUDGET and not out.auto
    assert "max_model_len=8192 (the model's context)" in said and "a CPU's default" in said


def test_a_card_takes_its_share_less_the_weights_and_the_reserve(arch):
    mem = DeviceMemory(total=80 * GiB, free=77 * GiB, held=3 * GiB)
    out, said = sizing.resolve(cfg(), arch, mem)
    s = out.scheduler
    assert (s.max_running, s.max_batched_tokens) == (256, 256 + sizing.CUDA_PROMPT_CHUNK)
    reserve = sizing.activation_reserve(arch, 256 + sizing.CUDA_PROMPT_CHUNK, 256)
    assert out.cache.kv_budget_bytes == int(0.9 * 80 * GiB) - 3 * GiB - reserve
    assert "0.90 of 80.0 GiB" in said


def test_the_step_has_a_decode_per_request_in_flight_and_a_prompt_chunk(arch):
    """However many requests are in flight, a step leaves prompts a whole chunk."""
    mem = DeviceMemory(total=80 * GiB, free=77 * GiB, held=3 * GiB)
    for running in (32, 512):
        given = dataclasses.replace(
            cfg(AUTO_LIMITS - {"max_running"}),
            scheduler=dataclasses.replace(cfg().scheduler, max_running=running),
        )
        out, said = sizing.resolve(given, arch, mem)
        step = out.scheduler.max_batched_tokens
        assert (
            step - running == sizing.CUDA_PROMPT_CHUNK
            and step <= given.runner.cuda_graph_max_tokens
        )
        assert f"max_batched_tokens={step} (a decode per request in flight" in said


def test_a_share_another_process_holds_part_of_is_refused(arch):
    """Taking only what is free would count the other process's reserve, not yet allocated,
    as ours: both would overflow the card at their peaks."""
    mem = DeviceMemory(total=80 * GiB, free=30 * GiB, held=3 * GiB)  # the other worker: 47 GiB
    with pytest.raises(ValueError, match="more than the 30.0 GiB free.*--gpu-memory-utilization"):
        sizing.resolve(cfg(), arch, mem)
    half = dataclasses.replace(
        cfg(), cache=dataclasses.replace(cfg().cache, gpu_memory_utilization=0.35)
    )
    out, _ = sizing.resolve(half, arch, mem)  # 28 GiB of the card: within the 30 free
    reserve = sizing.activation_reserve(arch, out.scheduler.max_batched_tokens, 256)
    assert out.cache.kv_budget_bytes == int(0.35 * 80 * GiB) - 3 * GiB - reserve


def test_a_full_card_refuses_to_start_saying_what_to_change(arch):
    mem = DeviceMemory(total=16 * GiB, free=1 * GiB, held=14 * GiB)
    with pytest.raises(ValueError, match="no room for a KV pool.*--kv-budget-mb"):
        sizing.resolve(cfg(), arch, mem)


def test_given_limits_are_kept_and_said_so(arch):
    given = cfg(auto=frozenset({"max_running"}))
    mem = DeviceMemory(total=80 * GiB, free=77 * GiB, held=3 * GiB)
    out, said = sizing.resolve(given, arch, mem)
    assert out.scheduler.max_running == 256
    assert out.scheduler.max_model_len == given.scheduler.max_model_len
    assert out.cache.kv_budget_bytes == given.cache.kv_budget_bytes
    assert "kv_budget=256 MiB (given)" in said


def test_serve_leaves_unset_limits_to_sizing_and_takes_given_ones(tiny_dir):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    bare = engine_config(p.parse_args(["--model", str(tiny_dir), "--device", "cpu"]))
    assert bare.auto == {"kv_budget", "max_model_len", "max_running", "max_batched_tokens"}
    argv = ["--model", str(tiny_dir), "--device", "cpu", "--max-running", "8"]
    some = engine_config(p.parse_args([*argv, "--kv-budget-mb", "32"]))
    assert some.auto == {"max_model_len", "max_batched_tokens"}
    assert some.scheduler.max_running == 8 and some.cache.kv_budget_bytes == 32 * 2**20
    with pytest.raises(ValueError, match="gpu memory utilization"):
        engine_config(p.parse_args([*argv, "--gpu-memory-utilization", "1.5"]))


def test_launch_divides_a_cards_share_among_the_workers_on_it():
    base = dict(
        model_path="/m",
        served_model_name="m",
        prefill=1,
        decode=1,
        threads=1,
        engine_flags=("--gpu-memory-utilization", "0.8"),
        log_dir="/tmp/x",
        cluster_key_file="/tmp/x/k",
        gpu_memory_utilization=0.8,
    )

    def share(plan: dict[str, list[str]], name: str) -> float:
        argv = plan[name]
        last = len(argv) - 1 - argv[::-1].index("--gpu-memory-utilization")
        return float(argv[last + 1])  # the last one wins in argparse

    shared = dict(worker_argvs(LaunchConfig(**base)))  # type: ignore[arg-type]
    assert share(shared, "prefill-0") == share(shared, "decode-0") == 0.4
    apart = dict(worker_argvs(LaunchConfig(**base, gpus=("0", "1"))))  # type: ignore[arg-type]
    assert share(apart, "prefill-0") == share(apart, "decode-0") == 0.8
