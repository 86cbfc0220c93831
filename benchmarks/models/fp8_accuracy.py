"""fp8 weights kept fp8 against the same checkpoint dequantised (issue 39, `--quantization`):
how far the fp8 path's tokens and log-probabilities move, and what it gains in speed.

    python benchmarks/models/fp8_accuracy.py [--device cuda --dtype bfloat16]
        [--models deepseek-v3-fp8-tiny large-v3] [--prompts 32 --prompt-tokens 64 --new-tokens 64]

Models: `deepseek-v3-fp8-tiny` (built in: DeepSeek's fp8 format, peaked logits), `large-v3` /
`large-v32` (benchmarks/models/deepseek.py's HF random init, hidden 1024) and `trained-v3`
(benchmarks/models/trained_tiny.py: the fp8-tiny architecture trained here for --train-steps
on the built-in corpus; its prompts are cut from held-out corpus text, the others' are random
ids), each written here in DeepSeek's fp8 format (every projection e4m3 with 128 x 128 float32
block scales, by model/builtin_weights.py `fp8_checkpoint`). For each, with `--prompts` prompts:
  * reference: the engine with `--quantization none` (weights dequantised to --dtype) decodes
    `--new-tokens` greedy tokens C per prompt;
  * teacher-forced: both paths score prompt + C (prompt_logprobs): at each of C's positions,
    `top-1 agree` is the share where the fp8 path's best token is C's token, `max |dlogprob|`
    and `mean |dlogprob|` compare the log-probability each path gives C's token (the logits'
    difference after normalisation);
  * free-running: the fp8 path's own greedy tokens: rows identical to C, and the share of
    positions equal to C's;
  * yardstick (`--dtype bfloat16`): the same three measures for the dequantised path in bf16
    against float32, i.e. how much this model's choices move under bf16 rounding alone;
  * speed: decode tok/s of both paths at batch `--prompts` (CUDA graphs on CUDA).
A benchmark, not a test: prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.models.deepseek import large_model  # noqa: E402
from benchmarks.models.trained_tiny import held_out_prompts, train  # noqa: E402
from pdserve.engine.offline import build_engine, generate  # noqa: E402
from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.model.builtin_weights import FP8_QUANTIZATION_CONFIG, fp8_checkpoint  # noqa: E402
from pdserve.protocol.outputs import RequestOutput  # noqa: E402
from pdserve.protocol.sampling import SamplingParams  # noqa: E402


def fp8_copy(src: Path, dst: Path) -> Path:
    """`src` (an unquantised HF directory) in DeepSeek's fp8 checkpoint format: each shard
    under its own name, the index (if any) naming the scales too."""
    dst.mkdir()
    index = src / "model.safetensors.index.json"
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f != index:
            shutil.copy(f, dst / f.name)
    where: dict[str, str] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors = fp8_checkpoint(load_file(str(f)))
        save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
        where |= dict.fromkeys(tensors, f.name)
    if index.exists():
        (dst / index.name).write_text(json.dumps({"metadata": {}, "weight_map": where}))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = FP8_QUANTIZATION_CONFIG
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def engine(path: Path, args: argparse.Namespace, quantization: str, dtype: str) -> Any:
    return build_engine(
        path, dtype=dtype, device=args.device, quantization=quantization, page_size=16,
        max_batched_tokens=1024, max_running=args.prompts, kv_budget_mb=args.kv_budget_mb,
        max_model_len=args.prompt_tokens + args.new_tokens + 16, prefix_cache=False,
    )  # fmt: skip


def scored(e: Any, seqs: list[list[int]]) -> list[list[tuple[int, float]]]:
    """Each sequence's prompt logprobs: (the best token, the given token's logprob) per
    position after the first."""
    got: dict[int, list[tuple[int, float]]] = {}
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    for i, s in enumerate(seqs):

        def sink(o: RequestOutput, i: int = i) -> None:
            if o.prompt_logprobs:
                got[i] = [(t.top[0][0], t.logprob) for t in o.prompt_logprobs]

        e.submit(f"score-{i}", s, params, sink)
    deadline = time.monotonic() + 600
    while len(got) < len(seqs):
        if time.monotonic() > deadline:
            raise RuntimeError("scoring did not finish in 600 s")
        e.tick()
    return [got[i] for i in range(len(seqs))]


def decode(e: Any, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    generate(e, prompts, params)  # untimed: graphs, allocations
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = generate(e, prompts, params)
    return out, len(prompts) * n / (time.perf_counter() - t)


def compare(
    ref: list[list[int]],
    ref_scores: list[list[tuple[int, float]]],
    scores: list[list[tuple[int, float]]],
    free: list[list[int]],
    prompt_tokens: int,
) -> dict[str, Any]:
    """Teacher-forced and free-running agreement of one path with the reference's tokens C."""
    agree = total = 0
    deltas: list[float] = []
    for c, rs, s in zip(ref, ref_scores, scores, strict=True):
        # Entry j scores token j + 1; C's tokens are prompt_tokens .. end (the last C token is
        # not in the scored sequence: prompt + C[:-1]).
        for j in range(prompt_tokens - 1, prompt_tokens - 1 + len(c) - 1):
            agree += s[j][0] == c[j - prompt_tokens + 1]
            total += 1
            deltas.append(abs(s[j][1] - rs[j][1]))
    same = sum(f == c for f, c in zip(free, ref, strict=True))
    pos = sum(x == y for f, c in zip(free, ref, strict=True) for x, y in zip(f, c, strict=True))
    d = torch.tensor(deltas)
    return {
        "top-1 agree": f"{100 * agree / total:.1f}%",
        "max |dlogprob|": f"{d.max().item():.3f}",
        "mean |dlogprob|": f"{d.mean().item():.4f}",
        "free-run rows equal": f"{same}/{len(ref)}",
        "free-run positions equal": f"{100 * pos / sum(map(len, ref)):.1f}%",
    }


def measure(
    path: Path, args: argparse.Namespace, prompts: list[list[int]] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """Both paths of `path` on `prompts` (None: `--prompts` random ones)."""
    if prompts is None:
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, 4000, (args.prompts, args.prompt_tokens), generator=g).tolist()
    n = args.new_tokens
    ref_engine = engine(path, args, "none", args.dtype)
    ref, ref_tps = decode(ref_engine, prompts, n)
    seqs = [p + c[:-1] for p, c in zip(prompts, ref, strict=True)]
    ref_scores = scored(ref_engine, seqs)
    del ref_engine
    fp8_engine = engine(path, args, "fp8", args.dtype)
    free, fp8_tps = decode(fp8_engine, prompts, n)
    row = compare(ref, ref_scores, scored(fp8_engine, seqs), free, args.prompt_tokens)
    row |= {"tok/s": f"{fp8_tps:,.0f}", "ref tok/s": f"{ref_tps:,.0f}"}
    del fp8_engine
    rows = [("fp8 vs dequantised", row)]
    if args.dtype != "float32":  # the yardstick: bf16 rounding alone, on the same tokens
        f32 = engine(path, args, "none", "float32")
        f32_free, _ = decode(f32, prompts, n)
        # The float32 path is the reference here: score ITS greedy tokens with both.
        f32_seqs = [p + c[:-1] for p, c in zip(prompts, f32_free, strict=True)]
        f32_scores = scored(f32, f32_seqs)
        del f32
        low = engine(path, args, "none", args.dtype)
        low_scores = scored(low, f32_seqs)
        yard = compare(f32_free, f32_scores, low_scores, ref, args.prompt_tokens)
        rows.append(
            (f"{args.dtype} vs float32 (dequantised)", yard | {"tok/s": "", "ref tok/s": ""})
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--kv-budget-mb", type=float, default=512.0)
    p.add_argument(
        "--models",
        nargs="+",
        default=["deepseek-v3-fp8-tiny", "large-v3"],
        choices=["deepseek-v3-fp8-tiny", "large-v3", "large-v32", "trained-v3"],
    )
    p.add_argument("--train-steps", type=int, default=600, help="trained-v3's training")
    args = p.parse_args()
    print(
        f"device {args.device}, {args.dtype}, {args.prompts} prompts x {args.prompt_tokens} "
        f"tokens, {args.new_tokens} greedy tokens each"
    )
    cols = [
        "top-1 agree", "max |dlogprob|", "mean |dlogprob|", "free-run rows equal",
        "free-run positions equal", "tok/s", "ref tok/s",
    ]  # fmt: skip
    table = []
    with tempfile.TemporaryDirectory(prefix="pdserve-fp8-") as tmp:
        for name in args.models:
            prompts = None
            if name.startswith("large-"):
                plain = large_model(name.removeprefix("large-"), Path(tmp))
                path = fp8_copy(plain, Path(tmp) / f"{name}-fp8")
            elif name == "trained-v3":
                plain = train(Path(tmp) / name, args.train_steps, 16, 128, 3e-3)
                path = fp8_copy(plain, Path(tmp) / f"{name}-fp8")
                prompts = held_out_prompts(plain, args.prompts, args.prompt_tokens)
            else:
                path = resolve_model(f"builtin:{name}")
            for what, row in measure(path, args, prompts):
                table.append((name, what, row))
                print(f"{name}, {what}: {row}", flush=True)
    print("\n| model | comparison | " + " | ".join(cols) + " |\n|---|---|" + "---:|" * len(cols))
    for name, what, row in table:
        print(f"| {name} | {what} | " + " | ".join(str(row[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
