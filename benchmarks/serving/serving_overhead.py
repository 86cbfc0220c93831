"""CPU seconds each process of a serving cluster spends per streamed token.

    python benchmarks/serving/serving_overhead.py [--num-prompts 64] [--concurrency 16]
        [--output-len 256] [--repeats 2] [--topology colocated|1p1d]
        [--worker-streams shared|per-request] [--engine-process]
        [--profile worker|router --py-spy PATH]

Starts `pdserve launch --prefill 0 --decode 1 --model builtin:tiny --device cpu` (with
`--topology 1p1d`: `--prefill 1 --decode 1`, the data plane shm) on free ports, streams N
completions (ignore_eos, so every answer is --output-len tokens) at concurrency C with `pdserve
bench`'s own client in this process, and reads every process's CPU time (utime + stime in
/proc/PID/stat, and per thread in /proc/PID/task/TID/stat) before and after. It prints, per
process, CPU milliseconds per 1,000 streamed tokens, split into the main thread (the asyncio
loop: HTTP, SSE, NDJSON, detokenising) and the other threads (in a worker, the engine thread
and torch's; in the router, the tokenizer pool). The client's row is this process (the bench
client: reading and parsing SSE).

The tiny model's step is cheap, so a CPU figure here is the serving path's cost per token,
which on a GPU host caps throughput where the engine would go faster (docs/architecture.md
§Streaming path). `--profile worker|router` also samples that process's main thread with
py-spy (`--py-spy`, or `py-spy` on PATH; `pip download py-spy` and unzip it if it is not
installed) during the measured run and prints the functions where it spends its time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.serving.launched import Pdserve, engine_pid  # noqa: E402
from benchmarks.serving.proc_cpu import Cpu, read_cpu  # noqa: E402
from pdserve.bench.config import ArrivalConfig, ClientConfig  # noqa: E402
from pdserve.bench.dataset import BenchRequest  # noqa: E402
from pdserve.bench.runner import Workload, run_workloads  # noqa: E402
from pdserve.runtime import evloop  # noqa: E402

PROFILE_TOP = 25


def requests(n: int, input_len: int, output_len: int) -> list[BenchRequest]:
    # Ids spread over a small range that every built-in vocabulary holds.
    return [
        BenchRequest(
            tuple((i * 7 + j * 13) % 200 + 10 for j in range(input_len)), input_len, output_len
        )
        for i in range(n)
    ]


def stream(url: str, args: argparse.Namespace, n: int) -> tuple[int, float]:
    """Stream n requests; (completion tokens, seconds). Raises if any failed."""
    client = ClientConfig(url=url, ignore_eos=True, request_timeout_s=args.timeout)
    work = Workload(
        "overhead",
        requests(n, args.input_len, args.output_len),
        ArrivalConfig(request_rate=float("inf"), max_concurrency=args.concurrency),
    )
    result = evloop.run(run_workloads(client, [work], warmup=0, progress=False))
    bad = [r for r in result.records if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed: {bad[0].error_key}: {bad[0].error_detail}")
    return sum(r.output_tokens for r in result.records), result.duration_s


def start_profile(py_spy: str, pid: int, out: Path) -> subprocess.Popen[bytes]:
    argv = [
        py_spy,
        "record",
        "--pid",
        str(pid),
        "--rate",
        "250",
        "--format",
        "raw",
        "--threads",
        "--output",
        str(out),
        "--nonblocking",
        "--gil",  # only while it holds the GIL: Python time, not waits in the kernel
    ]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def summarize_profile(path: Path, pid: int, thread: str = "main") -> None:
    """py-spy's collapsed stacks -> one thread's top functions, self and inclusive: the main
    thread, or the threads whose name contains `thread` (e.g. "engine")."""
    self_n: collections.Counter[str] = collections.Counter()
    incl_n: collections.Counter[str] = collections.Counter()
    total = 0
    main = f"thread ({pid})"  # py-spy --threads: "thread (TID): NAME;frame;frame COUNT"
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        ours = frames[0].startswith(main) if thread == "main" else thread in frames[0]
        if not ours:
            continue
        n = int(count)
        total += n
        fns = frames[1:]
        if fns:
            self_n[fns[-1]] += n
        for f in set(fns):
            incl_n[f] += n
    if not total:
        print(f"no samples of the {thread} thread of {pid} in {path}")
        return
    print(f"\n{thread} thread of {pid}: {total} samples while holding the GIL")
    print("  self%   function")
    for f, n in self_n.most_common(PROFILE_TOP):
        print(f"  {100 * n / total:5.1f}   {f}")
    print("  incl%   function")
    for f, n in incl_n.most_common(PROFILE_TOP):
        print(f"  {100 * n / total:5.1f}   {f}")


def measure(args: argparse.Namespace, log_dir: Path) -> list[dict[str, object]]:
    argv = [
        "launch",
        "--prefill",
        "1" if args.topology == "1p1d" else "0",
        "--decode",
        "1",
        "--model",
        "builtin:tiny",
        "--device",
        "cpu",
        "--threads",
        str(args.threads),
        "--max-running",
        str(max(args.concurrency, 1)),
        "--worker-streams",
        args.worker_streams,
        *(["--engine-process"] if args.engine_process else []),
    ]
    runs: list[dict[str, object]] = []
    with Pdserve(argv, log_dir) as cluster:
        procs = {p["name"]: int(p["pid"]) for p in cluster.table()}
        for p in cluster.table():  # each worker's engine process, a row of its own
            if p["name"] != "router" and (pid := engine_pid(p["url"], log_dir / "cluster.key")):
                procs[p["name"] + "-engine"] = pid
        stream(cluster.url, args, min(args.concurrency, args.num_prompts))  # warm up
        for rep in range(args.repeats):
            profiler = None
            prof_out = log_dir / f"profile-{rep}.txt"
            if args.profile and rep == args.repeats - 1:
                profiler = start_profile(
                    args.py_spy, pid_of(procs, args.profile, args.profile_thread), prof_out
                )
                time.sleep(1.0)  # py-spy attaches
            before = {name: read_cpu(pid) for name, pid in procs.items()}
            me = read_cpu(os.getpid())
            tokens, seconds = stream(cluster.url, args, args.num_prompts)
            after = {name: read_cpu(pid) for name, pid in procs.items()}
            mine = read_cpu(os.getpid())
            rows = {name: after[name] - before[name] for name in procs}
            rows["client"] = mine - me
            report(rep, tokens, seconds, rows)
            runs.append(
                {
                    "tokens": tokens,
                    "seconds": seconds,
                    "ms_per_1k_tokens": {
                        n: {
                            "main": 1e6 * c.main_s / tokens,
                            "other": 1e6 * c.other_s / tokens,
                            "kernel": 1e6 * c.kernel_s / tokens,
                        }
                        for n, c in rows.items()
                    },
                }
            )
            if profiler is not None:
                profiler.send_signal(2)  # SIGINT: py-spy writes its output and exits
                try:
                    _, err = profiler.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    profiler.kill()
                    _, err = profiler.communicate(timeout=10)
                if prof_out.exists():
                    summarize_profile(
                        prof_out,
                        pid_of(procs, args.profile, args.profile_thread),
                        args.profile_thread,
                    )
                else:
                    print(f"py-spy wrote nothing: {err.decode(errors='replace')[-500:]}")
    return runs


def pid_of(procs: dict[str, int], which: str, thread: str = "main") -> int:
    """The router's pid, or the worker's: the decode worker in 1P+1D, else the co-located one;
    for a thread other than main, the worker's engine process where it has one."""
    if which == "router":
        return procs["router"]
    workers = [n for n in procs if n != "router" and not n.endswith("-engine")]
    name = next((n for n in workers if n.startswith("decode")), workers[0])
    if thread != "main" and f"{name}-engine" in procs:
        return procs[f"{name}-engine"]
    return procs[name]


def report(rep: int, tokens: int, seconds: float, rows: dict[str, Cpu]) -> None:
    print(f"\nrun {rep}: {tokens} tokens in {seconds:.2f}s ({tokens / seconds:.0f} tok/s)")
    print(
        f"  {'process':<14} {'CPU ms / 1k tokens':>19} {'main thread':>12} "
        f"{'other threads':>14} {'in kernel':>10}"
    )
    for name, c in rows.items():
        per = 1e6 / tokens
        print(
            f"  {name:<14} {c.total_s * per:>19.1f} {c.main_s * per:>12.1f} "
            f"{c.other_s * per:>14.1f} {c.kernel_s * per:>10.1f}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--topology",
        choices=["colocated", "1p1d"],
        default="colocated",
        help="one co-located worker, or a prefill and a decode worker (shm between them)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads of the worker")
    p.add_argument(
        "--worker-streams",
        choices=["shared", "per-request"],
        default="shared",
        help="the router's --worker-streams: one output stream per worker, or per request",
    )
    p.add_argument(
        "--engine-process",
        action="store_true",
        help="workers with --engine-process: each one's engine process is a row of its own",
    )
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument(
        "--profile",
        choices=("worker", "router"),
        default=None,
        help="sample this process's main thread with py-spy in the last run",
    )
    p.add_argument(
        "--profile-thread",
        default="main",
        help="the thread --profile summarises: main, or a name it contains (e.g. engine)",
    )
    p.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="serving-overhead-") as tmp:
        runs = measure(args, Path(tmp))
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"json": None, "py_spy": None}, "runs": runs},
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
