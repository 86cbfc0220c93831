"""Serving on a GPU: `pdserve bench` against a co-located GPU cluster and a 1P+1D GPU cluster.

Both are started with `pdserve launch` on this machine's GPUs (KV moves over --backend, nixl by
default: VRAM to VRAM through UCX's cuda_ipc). On one GPU the 1P+1D pair shares it; on a host
with several, `launch` puts each worker on its own (`--gpus auto`), and a cluster named with
`-shared` (e.g. `1p1d-shared`) is launched with `--gpus none` so that its pair shares one GPU
for the comparison (benchmarks/engine/gpu_sharing.py measures what sharing costs); one named with
`-perreq` (e.g. `colocated-perreq`) has its router read one /generate stream per request
instead of one shared output stream per worker (`--worker-streams`); one named with
`-engproc` runs each worker's engine in a process of its own (`--engine-process`), one with
`-inproc` in the worker (`--no-engine-process`), and a plain name has serve's default (an
engine process on CUDA, none on a CPU; the row's `engine_process`, from the worker's /info).
Each row names its
workers' GPUs (`placement`, from the launcher's cluster.json). Then measured with the same
workload: random prompts of --input-len tokens, --output-len tokens out, at each
--concurrency. Reports output tokens/s, TTFT and ITL p50/p99 per cluster and concurrency, and
the 1P+1D / co-located ratio of ITL p50, side by side, and the output tokens per SSE chunk
(above 1.0 a stage fell behind and merged). Beside them, the host's side: how many
cores each process used at that rate (CPU per token, from /proc, times the tokens/s), its
main thread (the asyncio loop: HTTP and streaming) apart from its other threads (the engine's
and torch's), and the bench client's: a main thread near 1.0 is a process whose loop sets the
pace; a worker whose two sides together pass ~1.0 shares one GIL between them. The client's
figure includes its own start (interpreter, imports): high on short runs. Where a TTFT goes,
from the workers' /metrics (means over the run): the engine's own (`engine_ttft_mean_ms`:
arrival in D's or the co-located engine to its first token; the rest of the client's figure is
HTTP, the router and streaming) and, for PD, D's wait for the KV (`kv_wait_mean_ms`: room
opened to decoding) and its part from the PrefillRequest on (`kv_transfer_mean_ms`: P's queue,
its prefill and the transfer). Writes every
`pdserve bench` JSON and a summary (--out DIR).

    python benchmarks/serving/gpu_serving.py --model builtin:llama3.2-1b-shape --out /tmp/serving
    python benchmarks/serving/gpu_serving.py --device cpu --model builtin:tiny \
        --clusters colocated --concurrency 4 --num-prompts 8 --input-len 16 \
        --output-len 8                                                    # a CPU smoke run
    python benchmarks/serving/gpu_serving.py --device cpu --dtype float32 --model builtin:tiny \
        --clusters colocated,colocated-engproc --sim-step-ms 1.5 --concurrency 32 \
        --num-prompts 512 --kv-budget-mb 256          # a CPU lab: a simulated 1.5 ms step

With --sim-step-ms the workers run no model (benchmarks/serving/sim_device.py): each step "runs"
that long on a simulated device while the engine thread waits as it waits for a GPU, so the
served ITL against the simulated step shows what the serving path adds to a tick whose host
share is the engine's own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.serving.launched import engine_pid, wait_healthy  # noqa: E402
from benchmarks.serving.proc_cpu import Cpu, read_tree_cpu  # noqa: E402
from benchmarks.serving.sim_device import HOST_ENV, SIM_ENV  # noqa: E402
from pdserve.engine_flags import engine_process_argv  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SIMDEVICE = Path(__file__).resolve().parent / "simdevice"  # sim_device's sitecustomize
UCX_GPU = "cuda_copy,cuda_ipc,cma,tcp,self"  # one host: VRAM by CUDA IPC (README §nixl)
WARMUP = 2  # requests `pdserve bench` sends before it measures


def engine_flag(name: str) -> bool | None:
    """A cluster's `--engine-process` from its name: None for serve's default."""
    return True if "-engproc" in name else False if "-inproc" in name else None


def launch(name: str, args: argparse.Namespace, port: int, out: Path) -> subprocess.Popen[bytes]:
    topology = ["--prefill", "0", "--decode", "1"]
    if not name.startswith("colocated"):
        backend = "tcp" if "-tcp" in name else args.backend
        topology = ["--prefill", "1", "--decode", "1", "--backend", backend]
    if "-plain" in name:  # without overlapped scheduling, for the comparison
        topology.append("--no-overlap-schedule")
    if "-shared" in name:  # every worker on the GPU the launcher sees first
        topology += ["--gpus", "none"]
    if "-mps" in name:  # the cluster's own MPS daemon (runtime/mps.py)
        topology.append("--mps")
    if "-perreq" in name:  # the router's old way: one /generate stream per request
        topology += ["--worker-streams", "per-request"]
    topology += engine_process_argv(engine_flag(name))
    if args.sim_step_ms and "-plain" not in name:  # sim_device.py: the CPU lab overlaps too
        topology.append("--overlap-schedule")
    cmd = [
        sys.executable, "-m", "pdserve", "launch", *topology,
        "--port", str(port),
        "--log-dir", str(out / f"{name}-logs"),
        "--model", args.model, "--device", args.device, "--dtype", args.dtype,
        "--kv-budget-mb", str(args.kv_budget_mb),
        "--max-running", str(max(args.concurrency)),
    ]  # fmt: skip
    if args.max_model_len != 0:  # 0: serve's own (the model's context)
        cmd += ["--max-model-len", str(args.max_model_len or args.input_len + args.output_len + 64)]
    step = re.search(r"-step(\d+)", name)  # this cluster's own step budget
    if step is not None:
        cmd += ["--max-batched-tokens", step.group(1)]
    elif args.max_batched_tokens is not None:
        cmd += ["--max-batched-tokens", str(args.max_batched_tokens)]
    if args.router_processes is not None:
        cmd += ["--router-processes", str(args.router_processes)]
    env = {**os.environ, "UCX_TLS": os.environ.get("UCX_TLS", UCX_GPU)}
    if args.sim_step_ms:
        env[SIM_ENV] = str(args.sim_step_ms)
        env[HOST_ENV] = str(args.sim_host_us)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SIMDEVICE), env.get("PYTHONPATH")]))
    log = (out / f"{name}-launch.log").open("wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def worker_counts(url: str) -> dict[str, float]:
    """A worker's own counters, from its /metrics: its inter-token gaps (`itl_sum` seconds,
    `itl_count`: the engine's side of the ITL, before any HTTP)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    names = {
        "pdserve_inter_token_latency_seconds_sum": "itl_sum",
        "pdserve_inter_token_latency_seconds_count": "itl_count",
        "pdserve_time_to_first_token_seconds_sum": "ttft_sum",
        "pdserve_time_to_first_token_seconds_count": "ttft_count",
        # a decode worker of a PD cluster: per request, room opened to decoding (kv_wait) and
        # PrefillRequest sent to KV complete (kv_transfer; P's queue and prefill included)
        "pdserve_pd_kv_wait_seconds_sum": "kv_wait_sum",
        "pdserve_pd_kv_wait_seconds_count": "kv_wait_count",
        "pdserve_pd_kv_transfer_seconds_sum": "kv_transfer_sum",
        "pdserve_pd_kv_transfer_seconds_count": "kv_transfer_count",
    }
    got: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in names:
            got[names[name]] = float(value)
    return got


def bench(
    url: str,
    name: str,
    conc: int,
    args: argparse.Namespace,
    out: Path,
    procs: dict[str, int],
    decode_url: str,
    prefill_url: str | None,
) -> dict[str, Any]:
    n = args.prompts_at_1 if conc == 1 else args.num_prompts
    path = out / f"{name}-c{conc}.json"
    cmd = [
        sys.executable, "-m", "pdserve", "bench", "--url", url,
        "--num-prompts", str(n), "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--max-concurrency", str(conc),
        "--warmup", str(WARMUP), "--out", str(path), "--no-progress",
        "--processes", str(min(args.bench_processes, conc)),
    ]  # fmt: skip
    before = {p: read_tree_cpu(pid) for p, pid in procs.items()}
    counts_before = worker_counts(decode_url)
    p_before = worker_counts(prefill_url) if prefill_url else {}
    client_before = _children_cpu_s()
    spies = start_profiles(args, procs, out / f"{name}-c{conc}")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.bench_timeout)
    finally:
        stop_profiles(spies)
    after = {p: read_tree_cpu(pid) for p, pid in procs.items()}
    counts_after = worker_counts(decode_url)
    p_after = worker_counts(prefill_url) if prefill_url else {}
    gaps = counts_after.get("itl_count", 0.0) - counts_before.get("itl_count", 0.0)

    def mean_ms(what: str, after: dict[str, float], before: dict[str, float]) -> float | None:
        n = after.get(f"{what}_count", 0.0) - before.get(f"{what}_count", 0.0)
        total = after.get(f"{what}_sum", 0.0) - before.get(f"{what}_sum", 0.0)
        return round(total / n * 1e3, 2) if n else None

    client_s = _children_cpu_s() - client_before
    if done.returncode != 0:
        raise RuntimeError(f"bench {name} c={conc} exited {done.returncode}: {done.stderr[-2000:]}")
    s = json.loads(path.read_text())["summary"]
    # what the CPU deltas served: the run and each client process's warm-up
    tokens = s["output_tokens"] + WARMUP * min(args.bench_processes, conc) * args.output_len
    rate = s["output_throughput"]
    used = {p: after[p] - before[p] for p in procs}
    return {
        "cluster": name,
        "concurrency": conc,
        "requests": s["completed"],
        "output_tok_s": round(rate, 1),
        "ttft_p50_ms": round(s["ttft_ms"]["median"], 2),
        "ttft_p99_ms": round(s["ttft_ms"]["p99"], 2),
        "itl_p50_ms": round(s["itl_ms"]["median"], 3),
        "itl_p99_ms": round(s["itl_ms"]["p99"], 3),
        # the client's mean gap beside the engine's own (its /metrics, warm-up included): equal
        # when every gap is the engine's tick, larger when the serving path delays tokens
        "itl_mean_ms": round(s["itl_ms"]["mean"], 3),
        "engine_itl_mean_ms": round(
            (counts_after.get("itl_sum", 0.0) - counts_before.get("itl_sum", 0.0)) / gaps * 1e3, 3
        )
        if gaps
        else None,
        # the worker's side of the TTFT: its engine's arrival to first token (the rest of the
        # client's is HTTP, the router and streaming)
        "engine_ttft_mean_ms": mean_ms("ttft", counts_after, counts_before),
        # D's side of the TTFT (PD only): waiting for P's KV, and P's part of that wait
        "kv_wait_mean_ms": mean_ms("kv_wait", counts_after, counts_before),
        "kv_transfer_mean_ms": mean_ms("kv_transfer", counts_after, counts_before),
        # P's engine: a room's request arriving there to its first token (queue and prefill)
        "prefill_ttft_mean_ms": mean_ms("ttft", p_after, p_before),
        # above 1.0: a stage fell behind and merged tokens into one chunk (ITL counts chunks)
        "tokens_per_chunk": None if (t := s["tokens_per_chunk"]) is None else round(t, 3),
        "cores_main_other": cores(used, client_s, tokens, rate),
    }


def start_profiles(
    args: argparse.Namespace, procs: dict[str, int], stem: Path
) -> list[subprocess.Popen[bytes]]:
    """`--profile NAMES`: py-spy samples each named process (and its children: a router's
    workers, a worker's engine process) while the bench runs, into STEM-NAME.txt as collapsed
    stacks (`py-spy record --format raw`), with idle frames left out."""
    if not args.profile:
        return []
    spy = shutil.which("py-spy") or args.py_spy
    if not spy:
        raise SystemExit("--profile needs py-spy on PATH (or --py-spy PATH)")
    spies = []
    for want in args.profile.split(","):
        for name, pid in procs.items():
            if name.startswith(want):
                cmd = [spy, "record", "--pid", str(pid), "--subprocesses", "--format", "raw"]
                cmd += ["--rate", "250", "--nonblocking", "-o", f"{stem}-{name}.txt"]
                log = open(f"{stem}-{name}.spy.log", "wb")  # noqa: SIM115 - lives with the child
                spies.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    time.sleep(1.0)  # py-spy attaches before the load starts
    return spies


def stop_profiles(spies: list[subprocess.Popen[bytes]]) -> None:
    for s in spies:
        s.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    for s in spies:
        try:
            s.wait(timeout=30)
        except subprocess.TimeoutExpired:
            s.kill()
            s.wait(timeout=10)


def _children_cpu_s() -> float:
    """CPU seconds of this process's ended children (the bench client, once it has exited)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def cores(used: dict[str, Cpu], client_s: float, tokens: int, rate: float) -> str:
    """Cores each process used at `rate` tokens/s: its CPU per token served times the rate
    ("router 0.91/0.00": main thread / other threads)."""
    per = rate / max(tokens, 1)
    parts = [f"{p} {c.main_s * per:.2f}/{c.other_s * per:.2f}" for p, c in used.items()]
    return ", ".join([*parts, f"client {client_s * per:.2f}"])


def cluster_table(name: str, out: Path, launcher_pid: int) -> dict[str, Any]:
    """The launcher's cluster.json, written as it announces the cluster (the router may answer
    /health a moment before): the table of `launcher_pid`, never an earlier run's left in
    the same --out (its pids are gone; reading them failed a run)."""
    path = out / f"{name}-logs" / "cluster.json"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):  # not written yet, or half written
            table = None
        if table is not None and table.get("launcher_pid") == launcher_pid:
            return table  # type: ignore[no-any-return]
        time.sleep(0.1)
    raise RuntimeError(f"{path}: no table of launcher {launcher_pid} within 30 s")


def placement(table: dict[str, Any]) -> str:
    """The workers' GPUs as the launcher wrote them ("prefill-0:0 decode-0:1"; "shared" when
    it placed none)."""
    gpus = [f"{p['name']}:{p['gpu']}" for p in table["processes"] if p.get("gpu") is not None]
    return " ".join(gpus) or "shared"


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def run_cluster(
    name: str, proc: subprocess.Popen[bytes], port: int, args: argparse.Namespace, out: Path
) -> list[dict[str, Any]]:
    """Every concurrency's bench against one started cluster."""
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, args.startup_timeout)
    table = cluster_table(name, out, proc.pid)
    where = placement(table)
    procs = {p["name"]: int(p["pid"]) for p in table["processes"]}
    decode_url = next(
        p["url"] for p in table["processes"] if p["name"].startswith(("colo", "decode"))
    )
    # as the worker resolved it (a plain name has serve's default for the device)
    prefill_url = next(
        (p["url"] for p in table["processes"] if p["name"].startswith("prefill")), None
    )
    own_engine = engine_pid(decode_url, Path(table["cluster_key_file"])) is not None
    rows = []
    for conc in args.concurrency:
        row = bench(url, name, conc, args, out, procs, decode_url, prefill_url)
        sim = {"step_ms": args.sim_step_ms, "host_us": args.sim_host_us}
        row.update(
            placement=where, engine_process=own_engine, sim=sim if args.sim_step_ms else None
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:llama3.2-1b-shape")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    ap.add_argument("--backend", default="nixl", choices=["nixl", "tcp"])
    ap.add_argument(
        "--clusters",
        default="colocated,1p1d",
        help="of colocated, 1p1d, either with -plain (no overlapped scheduling), -perreq (a "
        "stream per request), -engproc (--engine-process) or -inproc (--no-engine-process; "
        "neither: serve's default), and 1p1d with -shared (--gpus none: both workers on one "
        "GPU); any with -mps: under the cluster's own MPS daemon (launch --mps); 1p1d "
        "with -tcp: KV over tcp whatever --backend says; any with -stepN: --max-batched-tokens N "
        "(in 1P+1D it bounds P's prompt steps: D's decode steps take one token a request)",
    )
    ap.add_argument("--concurrency", default="32,64,128,256,512")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--prompts-at-1", type=int, default=64, help="prompts at concurrency 1")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-budget-mb", type=float, default=16384)
    ap.add_argument(
        "--max-model-len", type=int, default=None,
        help="serve's (default: input + output + 64; 0: serve's own, the model's context)",
    )  # fmt: skip
    ap.add_argument(
        "--max-batched-tokens", type=int, default=None, help="serve's (default: its own)"
    )
    ap.add_argument(
        "--sim-step-ms",
        type=float,
        default=0.0,
        help="a CPU lab: no model, each step takes this long on a simulated device "
        "(benchmarks/serving/sim_device.py; with --device cpu)",
    )
    ap.add_argument(
        "--sim-host-us",
        type=float,
        default=0.0,
        help="with --sim-step-ms: extra host work (a GIL-holding spin) per chunk of a step",
    )
    ap.add_argument(
        "--router-processes",
        type=int,
        default=None,
        help="launch --router-processes (default: launch's)",
    )
    ap.add_argument("--bench-processes", type=int, default=1, help="pdserve bench --processes")
    ap.add_argument(
        "--profile",
        default="",
        help="comma-separated process names of the cluster table (e.g. router,decode) to "
        "sample with py-spy during each bench: NAME-cC-PROC.txt, collapsed stacks",
    )
    ap.add_argument("--py-spy", default="", help="py-spy's path, when it is not on PATH")
    ap.add_argument("--startup-timeout", type=float, default=240)
    ap.add_argument("--bench-timeout", type=float, default=600)
    ap.add_argument("--out", default="gpu_serving")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for k, name in enumerate(args.clusters.split(",")):
        port = 18000 + k
        with contextlib.ExitStack() as stack:
            proc = launch(name, args, port, out)
            stack.callback(stop, proc)
            rows += run_cluster(name, proc, port, args, out)
    colo = {r["concurrency"]: r for r in rows if r["cluster"] == "colocated"}
    for r in rows:
        base = colo.get(r["concurrency"])
        if base is not None:  # the three ratios, side by side
            r["tok_s_vs_colocated"] = round(r["output_tok_s"] / base["output_tok_s"], 3)
            r["ttft_p50_vs_colocated"] = round(r["ttft_p50_ms"] / base["ttft_p50_ms"], 3)
            r["itl_p50_vs_colocated"] = round(r["itl_p50_ms"] / base["itl_p50_ms"], 3)
    (out / "summary.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    cols = list(rows[0]) if rows else []
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
