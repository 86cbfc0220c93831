"""PD parity on a GPU: a 1P+1D cluster (`--backend tcp`, both workers on CUDA) vs the
in-process engine on the same device, 64 concurrent mixed-length greedy requests.

    python benchmarks/serving/pd_cuda.py --model builtin:tiny --device cuda --dtype float32
    python benchmarks/serving/pd_cuda.py --no-engine-process  # each engine in its worker's process
    python benchmarks/serving/pd_cuda.py --device cpu --backend shm --prefill-tp 2 --decode-tp 1
        # PD between tensor-parallel layouts (CPU, shm or tcp) against the TP-1 engine
    python benchmarks/serving/pd_cuda.py --device cpu --backend shm --model \
        builtin:deepseek-v3-tiny --dp 2    # both sides attention data-parallel (--dp 2 --ep)

Prints how many of the 64 answers match token for token (the completions' tokens as ids,
`return_tokens_as_token_ids`: a text would differ where an answer ends inside a UTF-8
character, which the server holds back as vLLM does), the cluster's wall time for the batch and
the KV bytes moved; exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.engine.offline import build_engine, generate  # noqa: E402
from pdserve.engine_flags import engine_process_argv  # noqa: E402
from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.protocol.sampling import SamplingParams  # noqa: E402
from pdserve.runtime.cluster_key import ClusterKey  # noqa: E402


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument(
        "--max-model-len", type=int, default=4096,
        help="both sides' (the CUDA graphs' page tables, so their split-KV counts, follow it)",
    )  # fmt: skip
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--backend", default="tcp", choices=["shm", "tcp", "nixl"])
    ap.add_argument("--prefill-tp", type=int, default=1, help="P's tensor parallelism")
    ap.add_argument("--decode-tp", type=int, default=1, help="D's tensor parallelism")
    ap.add_argument(
        "--dp", type=int, default=1,
        help="data-parallel attention over this many ranks on both sides (launch --dp N --ep; "
        "DeepSeek-V3/V3.2)",
    )  # fmt: skip
    ap.add_argument("--threads", type=int, default=0, help="launch --threads (0: launch's)")
    ap.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="as `serve`'s, for both workers (default: serve's, on for CUDA)",
    )
    args = ap.parse_args()
    path = resolve_model(args.model)
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 4 * args.chunk, (64,), generator=g).tolist()
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    engine = build_engine(
        path, dtype=args.dtype, device=args.device, max_batched_tokens=args.chunk,
        kv_budget_mb=1024, max_model_len=args.max_model_len,
    )  # fmt: skip
    want = generate(engine, prompts, params)  # token ids: the oracle is token for token
    del engine
    log_dir = Path(tempfile.mkdtemp(prefix="pd-cuda-"))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve",
            "launch",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--backend",
            args.backend,
            "--model",
            str(path),
            "--served-model-name",
            "m",
            "--port",
            "0",
            "--device",
            args.device,
            "--dtype",
            args.dtype,
            "--max-batched-tokens",
            str(args.chunk),
            "--max-model-len",
            str(args.max_model_len),
            "--kv-budget-mb",
            "1024",
            "--log-dir",
            str(log_dir),
            "--prefill-tp",
            str(args.prefill_tp if args.dp == 1 else args.dp),
            "--decode-tp",
            str(args.decode_tp if args.dp == 1 else args.dp),
            *(["--threads", str(args.threads)] if args.threads else []),
            *(["--dp", str(args.dp), "--ep"] if args.dp > 1 else []),
            *engine_process_argv(args.engine_process),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = ""
        deadline = time.monotonic() + 300
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("READY "):
                url = line.split()[1]
                break
            if time.monotonic() > deadline:
                break
        if not url:
            print("cluster did not start", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        with ThreadPoolExecutor(64) as pool:
            got = list(
                pool.map(
                    lambda p: post(
                        url + "/v1/completions",
                        {
                            "model": "m",
                            "prompt": p,
                            "max_tokens": args.new_tokens,
                            "temperature": 0,
                            "ignore_eos": True,
                            "logprobs": 0,  # the tokens, as ids (vLLM's "token_id:N")
                            "return_tokens_as_token_ids": True,
                        },
                    )["choices"][0]["logprobs"]["tokens"],
                    prompts,
                )
            )  # type: ignore[index]
        wall = time.perf_counter() - t0
        # /debug/* needs the cluster key's token; launch wrote the key in its log dir.
        headers = ClusterKey.load(log_dir / "cluster.key").http_headers
        cluster = urllib.request.Request(url + "/debug/cluster", headers=headers)
        with urllib.request.urlopen(cluster, timeout=30) as r:
            doc = json.loads(r.read())
        workers = doc["workers"]
        # as the workers resolved it (with no flag, serve's default for the device)
        engines = [(w.get("info") or {}).get("engine_pid") for w in doc["router"]["workers"]]
        moved = sum(
            w["state"]["engine"]["role"]["stats"]["bytes_written"]
            for w in workers.values()
            if w["role"] == "prefill"
        )
        ids = [[int(t.removeprefix("token_id:")) for t in toks] for toks in got]
        same = sum(a == b for a, b in zip(ids, want, strict=True))
        print(
            json.dumps(
                {
                    "model": args.model,
                    "device": args.device,
                    "dtype": args.dtype,
                    "backend": args.backend,
                    "tp": f"{args.prefill_tp}P+{args.decode_tp}D"
                    if args.dp == 1
                    else f"{args.dp}P+{args.dp}D",
                    "dp": args.dp,
                    "engine_process": all(pid is not None for pid in engines),
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    "exact": f"{same}/64",
                    "batch_wall_s": round(wall, 2),
                    "kv_mib_moved": round(moved / 2**20, 2),
                }
            )
        )
        return 0 if same == 64 else 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(log_dir, ignore_errors=True)  # it holds the cluster's key


if __name__ == "__main__":
    sys.exit(main())
