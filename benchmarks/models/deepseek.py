"""DeepSeek-V3 / V3.2 throughput: pdserve's offline engine against HF transformers' generate,
on the same checkpoint, in the same run (issue 16).

    python benchmarks/models/deepseek.py [--device cpu|cuda] [--dtype float32|bfloat16]
        [--batch 8 --prompt-tokens 64 --new-tokens 32] [--models deepseek-v3-tiny ...]

Models: `deepseek-v3-tiny` and `deepseek-v32-tiny` (built in), and `large-v3` / `large-v32`, a
DeepSeek-shaped config generated here with HF's random init and save_pretrained (hidden 1024,
8 layers, the first dense, 16 routed experts in 4 groups, 2 shared-width experts, q_lora 384,
kv_lora 256; V3.2 adds 16 indexer heads of 64 with index_topk 64, so prompts past 64 tokens
attend sparsely). `real-v3` / `real-v32`: DeepSeek-V3's (V3.2's) real per-layer dims, one
dense layer and `--moe-layers` MoE ones, the tiny tokenizer's vocabulary, written by
benchmarks/models/deepseek_checkpoint.py (47 GB in bf16 with 2 MoE layers: run them with
`--dtype bfloat16` on an 80 GB GPU; `--fp8` writes DeepSeek's block fp8, which pdserve keeps
fp8 on a GPU (`--quantization auto`) and HF loads through its own fp8 integration,
`--skip-hf` if it cannot; `--scale smoke` is the same at a CPU's size). Keep their prompts
short: a step that mixes decodes with a prompt's chunk runs MLA expanded over every sequence
in it, padded to the longest (benchmarks/engine/deepseek_decode.py says what that costs).

Every model runs `--batch` prompts of `--prompt-tokens` random ids each, `--new-tokens` greedy
tokens each (EOS ignored), all submitted at once: pdserve's engine (`engine/offline.py`; page
16, 512 tokens a step, prefix cache off; on CUDA with its decode steps as CUDA graphs, and again
eagerly, `--enforce-eager`) and HF's `generate` on the unpadded batch (every prompt the same
length, so no padding and no attention mask tricks). Each side runs once untimed first
(allocations, lazy init), then `--repeats` timed runs; the best is reported. tokens/s = batch *
new tokens / wall time (prefill included). `ids equal`: how many rows produced exactly HF's ids
(float32 parity holds on the tiny models; the random large ones have near-ties, so a few rows
may differ). Each model is on the device alone: each engine, then HF's model, is built, timed
and freed before the next (the real ones would not fit twice); HF loads straight onto the device
(`device_map`). Phase times go to stderr. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.models import deepseek_checkpoint as checkpoint  # noqa: E402
from pdserve.engine.offline import build_engine, generate  # noqa: E402
from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.protocol.sampling import SamplingParams  # noqa: E402

LARGE = {
    "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 384,
    "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
    "moe_intermediate_size": 256, "n_routed_experts": 16, "n_group": 4, "topk_group": 2,
    "num_experts_per_tok": 4, "n_shared_experts": 2, "first_k_dense_replace": 1,
}  # fmt: skip
LARGE_V32 = {"index_n_heads": 16, "index_head_dim": 64, "index_topk": 64}


def large_model(arch: str, root: Path) -> Path:
    """A DeepSeek-shaped HF directory: the tiny model's config and tokenizer, LARGE's shape,
    HF's own random init (float32), written by save_pretrained."""
    import transformers

    tiny = resolve_model(f"builtin:deepseek-{arch}-tiny")
    out = root / f"large-{arch}"
    out.mkdir()
    for f in tiny.iterdir():
        if f.suffix == ".json" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((tiny / "config.json").read_text())
    cfg.update(LARGE, **(LARGE_V32 if arch == "v32" else {}), head_dim=LARGE["qk_rope_head_dim"])
    (out / "config.json").write_text(json.dumps(cfg))
    config = transformers.AutoConfig.from_pretrained(out)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    return out


def phase(what: str, t0: float) -> None:
    print(f"  {what}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def free(device: str) -> None:
    """Return what the last model held to the device (its engine's cycles included)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated() / 2**30
        print(f"  freed: {held:.2f} GiB still allocated", file=sys.stderr, flush=True)


def timed(fn: Any, repeats: int) -> tuple[float, Any]:
    fn()  # untimed: allocations, lazy initialisation
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def time_pdserve(
    path: Path, args: argparse.Namespace, prompts: list[list[int]], eager: bool
) -> tuple[float, list[list[int]]]:
    """(best seconds, ids) of pdserve's engine; the engine is garbage when this returns."""
    t0 = time.perf_counter()
    engine = build_engine(
        path, dtype=args.dtype, device=args.device, page_size=16, max_batched_tokens=512,
        max_running=max(args.batch, 1), kv_budget_mb=args.kv_budget_mb,
        max_model_len=args.prompt_tokens + args.new_tokens + 16, prefix_cache=False,
        enforce_eager=eager,
    )  # fmt: skip
    phase(f"pdserve {'eager' if eager else 'graphs'}: load and build", t0)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    out = timed(lambda: generate(engine, prompts, params), args.repeats)
    phase(f"pdserve {'eager' if eager else 'graphs'}: {1 + args.repeats} runs", t0)
    return out


def time_hf(
    path: Path, args: argparse.Namespace, prompts: torch.Tensor
) -> tuple[float, list[list[int]]]:
    """(best seconds, ids) of HF's generate; the model is garbage when this returns."""
    import transformers

    t0 = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, args.dtype), device_map=args.device
    ).eval()
    hf.generation_config.eos_token_id = None
    phase("HF: load", t0)
    n_new = args.new_tokens

    def hf_run() -> list[list[int]]:
        with torch.no_grad():
            out = hf.generate(
                prompts.to(args.device), max_new_tokens=n_new, min_new_tokens=n_new,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        return out[:, args.prompt_tokens :].tolist()  # type: ignore[no-any-return]

    t0 = time.perf_counter()
    out = timed(hf_run, args.repeats)
    phase(f"HF: {1 + args.repeats} runs", t0)
    return out


def bench(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 4000, (args.batch, args.prompt_tokens), generator=g)
    seconds: dict[bool, float] = {}
    for eager in (True, False) if args.device == "cuda" else (True,):
        seconds[eager], ours = time_pdserve(path, args, prompts.tolist(), eager)
        free(args.device)  # before the next model loads
    ours_s = seconds[args.device != "cuda"]  # graphs on CUDA, eager elsewhere
    tokens = args.batch * args.new_tokens
    if args.skip_hf:
        return {
            "pdserve tok/s": tokens / ours_s,
            "pdserve eager tok/s": tokens / seconds[True],
            **dict.fromkeys(("HF tok/s", "speedup", "ids equal"), "-"),
        }
    hf_s, ref = time_hf(path, args, prompts)
    free(args.device)
    return {
        "pdserve tok/s": tokens / ours_s,
        "pdserve eager tok/s": tokens / seconds[True],
        "HF tok/s": tokens / hf_s,
        "speedup": hf_s / ours_s,
        "ids equal": f"{sum(a == b for a, b in zip(ours, ref, strict=True))}/{args.batch}",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--kv-budget-mb", type=float, default=256.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--skip-hf", action="store_true", help="pdserve's engine only")
    p.add_argument(
        "--models",
        nargs="+",
        default=["deepseek-v3-tiny", "deepseek-v32-tiny", "large-v32"],
        choices=[
            "deepseek-v3-tiny", "deepseek-v32-tiny", "large-v3", "large-v32", "real-v3", "real-v32"
        ],
    )  # fmt: skip
    checkpoint.add_arguments(p)
    args = p.parse_args()
    real = [m for m in args.models if m.startswith("real-")]
    if real and args.device == "cuda" and args.scale == "real" and args.dtype == "float32":
        p.error(f"{real[0]} is 95 GB in float32: pass --dtype bfloat16")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"device {args.device}, {args.dtype}, batch {args.batch} x {args.prompt_tokens} prompt "
        f"tokens, {args.new_tokens} new tokens each, torch threads {torch.get_num_threads()}"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-deepseek-") as tmp:
        for name in args.models:
            if name.startswith("real-"):
                spec = checkpoint.spec_of(name, args)
                device = checkpoint.write_device(args)
                with checkpoint.generated(spec, device, args.root, args.keep) as written:
                    print(checkpoint.describe(spec, written), flush=True)
                    rows.append((name, bench(written.path, args)))
            elif name.startswith("large-"):
                path = large_model(name.removeprefix("large-"), Path(tmp))
                rows.append((name, bench(path, args)))
            else:
                rows.append((name, bench(resolve_model(f"builtin:{name}"), args)))
            print(f"{name}: {rows[-1][1]}", flush=True)
    cols = ["pdserve tok/s", "pdserve eager tok/s", "HF tok/s", "speedup", "ids equal"]
    print("\n| model | " + " | ".join(cols) + " |\n|---|" + "---:|" * len(cols))
    for name, r in rows:
        cells = [f"{r[c]:.1f}" if isinstance(r[c], float) else r[c] for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
