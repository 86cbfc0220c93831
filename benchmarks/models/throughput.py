"""Offline generation throughput: pdserve's engine vs HF transformers, same prompts, same run.

    python benchmarks/models/throughput.py --model builtin:qwen2-0.5b-shape --device cuda \
        --dtype bfloat16 --batch 32 --input-len 256 --output-len 128

HF runs `generate` on the whole batch at once (left-padded, greedy, static batch); pdserve
submits the same prompts to its continuous-batching engine. Both generate exactly
`--output-len` tokens per prompt (EOS ignored). Reports tokens/s and the ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.engine.offline import build_engine, generate  # noqa: E402
from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.protocol.sampling import SamplingParams  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_hf(
    path: Path, prompts: list[list[int]], out_len: int, dtype: torch.dtype, device: str
) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model.generation_config.eos_token_id = None
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    with torch.no_grad():
        model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(
            ids, max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0
        )
        sync(device)
        dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + out_len
    del model
    return dt


def run_ours(path: Path, prompts: list[list[int]], out_len: int, args: argparse.Namespace) -> float:
    engine = build_engine(
        path,
        dtype=args.dtype,
        device=args.device,
        page_size=args.page_size,
        max_batched_tokens=args.max_batched_tokens,
        max_running=len(prompts),
        kv_budget_mb=args.kv_budget_mb,
    )
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    generate(engine, [p[:8] for p in prompts[:2]], SamplingParams(max_tokens=4))  # warm-up
    sync(args.device)
    t0 = time.perf_counter()
    outs = generate(engine, prompts, params)
    sync(args.device)
    dt = time.perf_counter() - t0
    assert all(len(o) == out_len for o in outs)
    return dt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-budget-mb", type=float, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = resolve_model(args.model)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 2000, (args.batch, args.input_len), generator=g).tolist()
    total = args.batch * args.output_len
    ours = run_ours(path, prompts, args.output_len, args)
    hf = run_hf(path, prompts, args.output_len, getattr(torch, args.dtype), args.device)
    row = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "batch": args.batch,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "pdserve_tok_s": round(total / ours, 1),
        "hf_tok_s": round(total / hf, 1),
        "ratio": round(hf / ours, 3),
    }
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
