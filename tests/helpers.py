"""Test shorthands over the offline engine API."""

from __future__ import annotations

from pathlib import Path

from pdserve.engine.engine import Engine
from pdserve.engine.offline import build_engine, generate

run = generate


def make_engine(
    path: Path,
    page_size: int = 16,
    chunk: int = 32,
    max_running: int = 32,
    kv_mb: float = 16.0,
    max_model_len: int = 1024,
    overlap: bool | None = None,
    prefill_wait_steps: int = 0,
) -> Engine:
    return build_engine(
        path,
        page_size=page_size,
        max_batched_tokens=chunk,
        max_running=max_running,
        kv_budget_mb=kv_mb,
        max_model_len=max_model_len,
        overlap_schedule=overlap,
        prefill_wait_steps=prefill_wait_steps,
    )


def hf_greedy(path: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF transformers' float32 greedy `generate` of each prompt alone, EOS off: the oracle."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
            out.append(ids[0, len(p) :].tolist())
    return out
