"""Greedy parity of pdserve's engine against HF transformers on any device and dtype.

    python benchmarks/models/parity.py --device cuda --dtype float32 --out parity.json

For each built-in model: prompts whose lengths straddle page and chunk boundaries, served
alone and all at once, compared token for token with `model.generate(do_sample=False)`.
Prints one line per model and writes the details as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.engine.offline import build_engine, generate  # noqa: E402
from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.protocol.sampling import SamplingParams  # noqa: E402


def hf_generate(
    path: Path, prompts: list[list[int]], n: int, dtype: torch.dtype, device: str
) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p], device=device), max_new_tokens=n, do_sample=False, pad_token_id=0
            )
            out.append(ids[0, len(p) :].tolist())
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--models", default="tiny,qwen2-tiny,qwen3-tiny,qwen2-0.5b-shape")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ps, ch = args.page_size, args.chunk
    lengths = sorted(
        {1, 2, ps - 1, ps, ps + 1, ch - 1, ch, ch + 1, 2 * ch - 1, 2 * ch, 2 * ch + 1, 200, 333}
    )
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    report = {
        "device": args.device,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "host": platform.node(),
        "lengths": lengths,
        "models": {},
    }
    ok_all = True
    for name in args.models.split(","):
        path = resolve_model(f"builtin:{name}")
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 2000, (n,), generator=g).tolist() for n in lengths]
        engine = build_engine(
            path,
            dtype=args.dtype,
            device=args.device,
            page_size=ps,
            max_batched_tokens=ch,
            kv_budget_mb=512,
        )
        t0 = time.perf_counter()
        alone = [generate(engine, [p], params)[0] for p in prompts]
        together = generate(engine, prompts, params)
        t_ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref = hf_generate(path, prompts, args.new_tokens, getattr(torch, args.dtype), args.device)
        t_hf = time.perf_counter() - t0
        exact = sum(a == r for a, r in zip(alone, ref, strict=True))
        same = sum(a == t for a, t in zip(alone, together, strict=True))
        first_diff = [
            next((i for i, (x, y) in enumerate(zip(a, r, strict=True)) if x != y), None)
            for a, r in zip(alone, ref, strict=True)
        ]
        report["models"][name] = {
            "exact_vs_hf": exact,
            "concurrent_eq_alone": same,
            "n": len(prompts),
            "first_divergence": first_diff,
            "ours_s": round(t_ours, 2),
            "hf_s": round(t_hf, 2),
        }
        ok_all &= exact == len(prompts) and same == len(prompts)
        print(
            f"{name:18s} {args.device} {args.dtype}: exact vs HF {exact}/{len(prompts)}, "
            f"concurrent == alone {same}/{len(prompts)}",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
