"""Offline generation: drive an Engine on the calling thread until a batch of prompts ends.

For benchmarks, parity checks and scripts (like vLLM's `LLM.generate`); the server runs the
same Engine on a supervised thread instead.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from pathlib import Path

from pdserve.config import CacheConfig, EngineConfig, ModelSpec, RunnerConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.request import RequestOutput
from pdserve.protocol.sampling import SamplingParams

_ids = itertools.count()


def build_engine(
    path: Path | str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    page_size: int = 16,
    max_batched_tokens: int = 512,
    max_running: int = 64,
    kv_budget_mb: float = 256.0,
    max_model_len: int = 4096,
    eos_token_ids: frozenset[int] = frozenset(),
    shared_pool: bool = False,
    attention_backend: str | None = None,
    enforce_eager: bool = False,
    cuda_graph_max_bs: int = 256,
    cuda_graph_max_tokens: int = RunnerConfig.cuda_graph_max_tokens,
    prefix_cache: bool = CacheConfig.prefix_cache,
    overlap_schedule: bool | None = None,
    index_k_dtype: str = CacheConfig.index_k_dtype,
    kv_dtype: str = CacheConfig.kv_dtype,
    quantization: str = ModelSpec.quantization,
    tp: int = 1,
    flight_dir: str | None = None,
    dp_attention: bool = False,
) -> Engine:
    """An engine for this thread to tick; `tp` > 1 starts its follower ranks, which the
    caller stops with `engine.tp.close()` (engine/tp_leader.py); `flight_dir`: where they
    write their flight recorders if they fail; `dp_attention`: each rank attends its own
    requests (`--dp tp --ep`)."""
    cfg = EngineConfig(
        ModelSpec(str(path), str(path), dtype=dtype, device=device, quantization=quantization),
        CacheConfig(
            page_size,
            int(kv_budget_mb * 2**20),
            prefix_cache,
            index_k_dtype=index_k_dtype,
            kv_dtype=kv_dtype,
        ),
        SchedulerConfig(
            max_batched_tokens=max_batched_tokens,
            max_running=max_running,
            max_model_len=max_model_len,
        ),
        RunnerConfig(
            attention_backend,
            enforce_eager,
            cuda_graph_max_bs,
            overlap_schedule,
            cuda_graph_max_tokens,
        ),
        tp=tp,
        flight_dir=flight_dir,
        dp_attention=dp_attention,
    )
    return Engine.build(cfg, eos_token_ids, shared_pool=shared_pool)


def generate(
    engine: Engine,
    prompts: Sequence[list[int]],
    params: SamplingParams | Sequence[SamplingParams],
    timeout_s: float = 600.0,
) -> list[list[int]]:
    """Submit every prompt at once and tick until all end; returns generated ids per prompt.

    Raises RuntimeError if a request fails or the batch is not done within `timeout_s`.
    """
    plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    outs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    ends: dict[int, RequestOutput] = {}
    base = f"offline-{next(_ids)}"
    for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):

        def sink(o: RequestOutput, i: int = i) -> None:
            outs[i].extend(o.token_ids)
            if o.finish_reason is not None:
                ends[i] = o

        engine.submit(f"{base}-{i}", p, sp, sink)
    deadline = time.monotonic() + timeout_s
    while len(ends) < len(prompts):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(prompts) - len(ends)} requests unfinished after {timeout_s}s")
        engine.tick()
    failed = {i: e.error for i, e in ends.items() if e.finish_reason not in ("stop", "length")}
    if failed:
        raise RuntimeError(f"requests failed: {failed}")
    return [outs[i] for i in range(len(prompts))]
