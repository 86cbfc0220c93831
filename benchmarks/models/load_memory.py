"""Peak vs steady resident memory while loading a model: pdserve's loader vs the previous one.

For each (loader, dtype), a fresh child process imports torch and pdserve, notes its RSS
(baseline), loads the model on the CPU, and reports from /proc/self/status its VmHWM (peak
RSS, loading included) and its VmRSS after gc.collect() (steady). Side by side:
  * pdserve: pdserve.model.loader.load_model (built on meta, parameters created empty in the
    target dtype, each tensor read in chunks with plain reads and cast on the way);
  * old: the loader before issue 12 part 9, reproduced here: built on meta, Module.to_empty
    in float32, the whole model cast to the target dtype, then each shard opened with
    safetensors' safe_open and every get_tensor() copied in.
The default model is builtin:qwen2-0.5b-shape (random weights with Qwen2-0.5B's dimensions,
a bfloat16 checkpoint in two shards, tied embeddings). The files are read once beforehand so
both loaders find them in the page cache (which is not part of a process's RSS).
Linux only (/proc). Usage:
  python benchmarks/models/load_memory.py [--model builtin:qwen2-0.5b-shape] \
      [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.model.config import ModelArch  # noqa: E402
from pdserve.model.llama import CausalLM, rope_inv_freq  # noqa: E402
from pdserve.model.loader import load_model, weight_files  # noqa: E402

LOADERS = ("pdserve", "old")
MIB = 1 << 20


def proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def load_old(path: Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """The previous loader's steps, error checks left out."""
    from safetensors import safe_open

    arch = ModelArch.from_dir(path)
    with torch.device("meta"):
        model = CausalLM(arch)
    model = model.to_empty(device=device)
    model.to(dtype)
    model.inv_freq = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling).to(device)
    params = dict(model.named_parameters())
    for f in weight_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name in params and not (arch.tie_word_embeddings and name == "lm_head.weight"):
                    with torch.no_grad():
                        params[name].copy_(st.get_tensor(name).to(dtype))
    model.tie_weights()
    return model.eval()


def child(loader: str, dtype_name: str, path: Path) -> None:
    dtype = getattr(torch, dtype_name)
    gc.collect()
    baseline = proc_status_kib("VmRSS")
    t0 = time.perf_counter()
    cpu = torch.device("cpu")
    model = load_model(path, dtype, cpu) if loader == "pdserve" else load_old(path, dtype, cpu)
    seconds = time.perf_counter() - t0
    peak = proc_status_kib("VmHWM")
    gc.collect()
    steady = proc_status_kib("VmRSS")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied counted once
    print(
        json.dumps(
            {
                "baseline": baseline * 1024,
                "peak": peak * 1024,
                "steady": steady * 1024,
                "weights": weights,
                "seconds": seconds,
            }
        )
    )


def measure(loader: str, dtype: str, path: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", loader, dtype, str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="builtin:qwen2-0.5b-shape")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--child", nargs=3, metavar=("LOADER", "DTYPE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], Path(args.child[2]))
        return
    path = resolve_model(args.model)
    for f in weight_files(path):  # warm the page cache for both loaders alike
        with open(f, "rb") as fh:
            while fh.read(64 * MIB):
                pass
    print(
        f"# {args.model} ({path}), torch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs"
    )
    print(
        "| loader | dtype | weights MiB | baseline MiB | peak MiB | steady MiB | peak / steady "
        "| (peak - baseline) / (steady - baseline) | load s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for loader in LOADERS:
            r = measure(loader, dtype, path)
            base, peak, steady = r["baseline"], r["peak"], r["steady"]
            print(
                f"| {loader} | {dtype} | {r['weights'] / MIB:.0f} | {base / MIB:.0f} "
                f"| {peak / MIB:.0f} | {steady / MIB:.0f} | {peak / steady:.2f} "
                f"| {(peak - base) / (steady - base):.2f} | {r['seconds']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
