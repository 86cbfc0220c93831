"""HF transformers' decode step with a static cache and torch.compile: the reference that
benchmarks/engine/gpu_decode.py puts beside pdserve's.

`generate` is run the way transformers documents static-cache generation:
`cache_implementation="static"` with a CompileConfig (mode reduce-overhead by default), which
makes `generate` compile the model's forward for the decode steps. The decode step time is the
difference of two `generate` lengths over the steps between them, so prefill, compilation and
the per-call setup cancel out; what is left is HF's own per-step cost (the compiled forward
plus generate's per-token work), which is what an HF user gets. generate compiles on CUDA
only: on a CPU the static cache runs eagerly, and the result says `hf_compiled: false`.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

SHORT = 2  # new tokens of the short generate: its prefill and setup are what cancels


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_decode_steps(
    path: Path,
    batches: list[int],
    *,
    ctx: int,
    steps: int,
    dtype: torch.dtype,
    device: torch.device,
    compile_mode: str = "reduce-overhead",
    reps: int = 3,
) -> dict[int, dict[str, Any]]:
    """batch -> {hf_step_ms, hf_tok_s, hf_warmup_s, hf_compiled} for the HF model in `path`
    decoding `ctx`-token random prompts; `compile_mode` "none" turns compilation off."""
    from transformers import AutoModelForCausalLM, CompileConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.to(device).eval()  # type: ignore[arg-type]
    model.generation_config.eos_token_id = None
    compile_kwargs: dict[str, Any] = (
        {"disable_compile": True}
        if compile_mode == "none"
        else {"compile_config": CompileConfig(mode=compile_mode, dynamic=False)}
        if device.type == "cuda"
        else {}  # generate never compiles on a CPU; a CompileConfig would only warn
    )
    if "compile_config" in compile_kwargs:
        # A clean slate per model: generate compiles `Module.__call__`, one code object for
        # every model, and torch.compile keeps at most 8 variants per code object.
        torch.compiler.reset()
    long = SHORT + steps
    out: dict[int, dict[str, Any]] = {}
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        vocab = min(model.config.vocab_size, 4000)
        ids = torch.randint(3, vocab, (batch, ctx), generator=g).to(device)

        def generate(n: int, ids: torch.Tensor = ids) -> float:
            _sync(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                seqs = model.generate(
                    ids,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                    cache_implementation="static",
                    **compile_kwargs,
                )
            _sync(device)
            if seqs.shape != (ids.shape[0], ids.shape[1] + n):
                raise RuntimeError(f"HF generated {tuple(seqs.shape)} for {n} new tokens")
            return time.perf_counter() - t0

        t0 = time.perf_counter()
        # Longest first: generate sizes its static cache to the longest length it has seen,
        # so the timed calls reuse one cache and one compiled graph.
        for n in (long, SHORT, long):
            generate(n)
        warm_s = time.perf_counter() - t0
        shorts, longs = [], []
        for _ in range(reps):  # interleaved, so a slow spell hits both lengths
            shorts.append(generate(SHORT))
            longs.append(generate(long))
        step_ms = (statistics.median(longs) - statistics.median(shorts)) / steps * 1e3
        out[batch] = {
            "hf_step_ms": round(step_ms, 4),
            "hf_tok_s": round(batch / step_ms * 1e3, 1),
            "hf_warmup_s": round(warm_s, 1),
            # generate keeps its compiled forward here (transformers' own attribute).
            "hf_compiled": getattr(model, "_compiled_call", None) is not None,
        }
        print(f"  HF batch {batch}: {out[batch]}", file=sys.stderr, flush=True)
    return out  # the model is freed with this frame
