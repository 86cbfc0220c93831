"""PD disaggregation vs one co-located worker, same cores, under prefill interference.

    python benchmarks/serving/pd_vs_colocated.py [--rounds 2] \
        [--plot benchmarks/pd_vs_colocated.png]

Configurations (all on the built-in tiny model, all on this machine's cores):
  colocated         `pdserve serve --threads 2`: one worker does prefill and decode.
  pd                `pdserve launch --prefill 1 --decode 1 --threads 1`: router + P + D.
  colocated-router  `pdserve launch --prefill 0 --decode 1 --threads 2`: the co-located
                    worker behind the same router, to separate the router's hop from PD.
  pd-d2, pd-p2      (with --configs) 1P+1D with 2 torch threads for D or for P, 1 for the
                    other: the same cores split another way (three threads on two cores).

Workload, two streams on one clock (pdserve.bench.runner):
  decode   short prompts, long outputs, a closed loop of --decode-streams in flight;
  prefill  long prompts, short outputs, Poisson arrivals at --prefill-rate.
In a co-located worker every long prompt's prefill chunks share steps with the decoding
streams, so their inter-token latency (ITL) jumps while a prompt is prefilled; PD moves that
work to another process. Whether that wins here depends on the cores: the P and D workers,
the router and this client all share them.

Prints a Markdown table (decode-stream ITL, long-prompt TTFT, goodput under --slo), writes
every run's JSON under --out-dir and one plot (ITL CDF of the decode streams, TTFT CDF).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.serving.launched import Pdserve  # noqa: E402
from pdserve.bench.config import ArrivalConfig, ClientConfig, DatasetConfig, Slo  # noqa: E402
from pdserve.bench.dataset import make_requests  # noqa: E402
from pdserve.bench.metrics import summarize_run  # noqa: E402
from pdserve.bench.plot import plot_compare  # noqa: E402
from pdserve.bench.record import RequestRecord, record_from_json  # noqa: E402
from pdserve.bench.report import write_json  # noqa: E402
from pdserve.bench.runner import RunResult, Workload, run_workloads  # noqa: E402


def split(prefill_threads: int, decode_threads: int) -> list[str]:
    """1P+1D with its own torch thread count per role."""
    threads = ["--prefill-threads", str(prefill_threads), "--decode-threads", str(decode_threads)]
    return ["launch", "--prefill", "1", "--decode", "1", *threads]


CONFIGS = {
    "colocated": ["serve", "--threads", "2"],
    "pd": ["launch", "--prefill", "1", "--decode", "1", "--threads", "1"],
    "colocated-router": ["launch", "--prefill", "0", "--decode", "1", "--threads", "2"],
    # The same two cores split another way: three torch threads on two cores.
    "pd-d2": split(prefill_threads=1, decode_threads=2),
    "pd-p2": split(prefill_threads=2, decode_threads=1),
}


def workloads(args: argparse.Namespace) -> list[Workload]:
    decode = DatasetConfig(
        num_prompts=args.decode_requests,
        input_len=args.decode_input,
        output_len=args.decode_output,
        seed=args.seed,
    )
    prefill = DatasetConfig(
        num_prompts=args.prefill_requests,
        input_len=args.prefill_input,
        output_len=args.prefill_output,
        seed=args.seed + 1,
    )
    return [
        Workload("decode", make_requests(decode), ArrivalConfig(max_concurrency=args.streams)),
        Workload(
            "prefill",
            make_requests(prefill),
            ArrivalConfig(request_rate=args.prefill_rate),
            seed=args.seed + 2,
        ),
    ]


def scaled(argv: list[str], cpus: int) -> list[str]:
    """A config's flags for `cpus` cores instead of 2: every thread count times cpus / 2."""
    out = list(argv)
    for i, flag in enumerate(out[:-1]):
        if flag in ("--threads", "--prefill-threads", "--decode-threads"):
            out[i + 1] = str(max(1, int(out[i + 1]) * cpus // 2))
    return out


def run_one(name: str, args: argparse.Namespace, slo: Slo, log_dir: Path) -> RunResult:
    argv = [*scaled(CONFIGS[name], args.cpus), "--model", args.model, "--device", args.device]
    with Pdserve(argv, log_dir) as server:
        client = ClientConfig(url=server.url, request_timeout_s=300.0)
        return asyncio.run(run_workloads(client, workloads(args), slo, warmup=2, progress=False))


def row(name: str, rnd: str, s: dict[str, Any]) -> str:
    dec, pre = s["workloads"]["decode"], s["workloads"]["prefill"]
    good = s.get("goodput", {})
    errors = ", ".join(f"{k} {v}" for k, v in s["errors"].items()) or "0"
    cells = [
        name,
        rnd,
        f"{dec['itl_ms']['median']:.1f}",
        f"{dec['itl_ms']['p99']:.1f}",
        f"{dec['tpot_ms']['p99']:.1f}",
        f"{pre['ttft_ms']['median']:.0f}",
        f"{pre['ttft_ms']['p99']:.0f}",
        f"{s['ttft_ms']['p99']:.0f}",
        f"{good.get('requests_per_s', 0.0):.2f} ({100 * good.get('fraction', 0.0):.0f}%)",
        f"{s['output_throughput']:.0f}",
        errors,
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| config | round | decode ITL p50 (ms) | decode ITL p99 (ms) | decode TPOT p99 (ms) "
    "| long-prompt TTFT p50 (ms) | long-prompt TTFT p99 (ms) | all TTFT p99 (ms) "
    "| goodput req/s (share) | output tok/s | errors |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return (
        f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, "
        f"torch {torch.__version__}, {platform.system()} {platform.release()}"
    )


@dataclass
class Run:
    config: str
    round: int
    records: list[RequestRecord]
    duration_s: float


def measure(args: argparse.Namespace, slo: Slo, out_dir: Path) -> list[Run]:
    runs = []
    for rnd in range(1, args.rounds + 1):
        for name in args.configs:  # interleaved, so that a noisy minute hits one round
            t = time.monotonic()
            result = run_one(name, args, slo, out_dir / f"{name}-{rnd}")
            write_json(out_dir / f"{name}-{rnd}.json", {"config": name, **vars(args)}, result)
            runs.append(Run(name, rnd, result.records, result.duration_s))
            print(f"{name} round {rnd}: {time.monotonic() - t:.0f}s", file=sys.stderr)
            print(row(name, str(rnd), result.summary), file=sys.stderr)
    return runs


def load(args: argparse.Namespace, from_dir: Path) -> list[Run]:
    """The runs a previous invocation wrote (NAME-ROUND.json), to re-tabulate and re-plot."""
    runs = []
    for name in args.configs:
        for path in sorted(from_dir.glob(f"{name}-*.json")):
            rnd = path.stem[len(name) + 1 :]
            if not rnd.isdigit():
                continue  # colocated-router-1.json also matches colocated-*
            doc = json.loads(path.read_text())
            records = [record_from_json(r) for r in doc["records"]]
            runs.append(Run(name, int(rnd), records, doc["summary"]["duration_s"]))
    if not runs:
        raise SystemExit(f"no NAME-ROUND.json runs in {from_dir}")
    return sorted(runs, key=lambda r: (r.round, args.configs.index(r.config)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--device", default="cpu", help="the workers' device (the study is on CPUs)")
    default_configs = ["colocated", "pd", "colocated-router"]
    p.add_argument("--configs", nargs="+", default=default_configs, choices=list(CONFIGS))
    p.add_argument("--rounds", type=int, default=1, help="repeat all configs, interleaved")
    p.add_argument(
        "--cpus",
        type=int,
        default=2,
        help="cores the run is pinned to (taskset): thread counts scale from the 2-core ones",
    )
    p.add_argument("--streams", type=int, default=8, help="decode streams in flight")
    p.add_argument("--decode-requests", type=int, default=80)
    p.add_argument("--decode-input", type=int, default=32)
    p.add_argument("--decode-output", type=int, default=256)
    p.add_argument("--prefill-rate", type=float, default=0.5, help="long prompts per second")
    p.add_argument("--prefill-requests", type=int, default=24)
    p.add_argument("--prefill-input", type=int, default=1024)
    p.add_argument("--prefill-output", type=int, default=16)
    p.add_argument("--slo", nargs="+", default=["ttft:1000", "tpot:50"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None, help="per-run JSON and logs (default: a temp dir)")
    p.add_argument("--from-dir", default=None, help="no new runs: tabulate an earlier --out-dir")
    p.add_argument("--plot", default="benchmarks/pd_vs_colocated.png")
    args = p.parse_args()
    slo = Slo.parse(args.slo)
    if args.from_dir:
        runs = load(args, Path(args.from_dir))
    else:
        out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="pd_vs_colocated-"))
        print(f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {machine()}; out {out_dir}")
        runs = measure(args, slo, out_dir)
    print(HEADER)
    for run in runs:
        print(row(run.config, str(run.round), summarize_run(run.records, run.duration_s, slo)))
    pooled: dict[str, list[RequestRecord]] = {}
    for name in args.configs:
        mine = [r for r in runs if r.config == name]
        if not mine:
            continue
        pooled[name] = [rec for r in mine for rec in r.records]
        total = sum(r.duration_s for r in mine)
        print(row(f"**{name}**", "all", summarize_run(pooled[name], total, slo)))
    rounds = max(r.round for r in runs)
    plot_compare(
        pooled,
        Path(args.plot),
        title=f"tiny model, {args.streams} decode streams + {args.prefill_input}-token prompts "
        f"at {args.prefill_rate}/s ({rounds} rounds pooled)",
        itl_workload="decode",
        ttft_workload="prefill",
    )
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
