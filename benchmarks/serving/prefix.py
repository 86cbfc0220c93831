"""Prefix cache benchmark (issue 15): multi-turn chat, cache off vs on vs a small pool + host tier.

    python benchmarks/serving/prefix.py [--conversations 32 --turns 6 --concurrency 8]
                                        [--topologies colocated pd] [--modes off on small host]

Workload (benchmarks/serving/chat_workload.py): one shared system prompt of about --system-tokens
tokens; --conversations conversations of --turns turns, all open at once, with at most
--concurrency requests in flight. Each conversation's turns go in order, so the conversations
interleave as users' do, and a conversation's next turn comes after most others' turns (its
prefix must survive that long in the cache). Every turn's prompt is the conversation so far
(system prompt, then each earlier "User: ..." message and the model's answer) plus a new user
message of about --user-tokens tokens; the answer is --output-tokens tokens (ignore_eos).
Requests stream through the router of `pdserve launch`, started by this script on a free port
and stopped by pid.

Topologies: colocated (`launch --prefill 0 --decode 1`) and pd (`launch --prefill 1 --decode 1`,
where P holds the cache); with --topologies, also colocated2 (two co-located workers, routed by
prefix) and colocated2-lo (the same, routed by least-outstanding), which show what cache-aware
routing is worth. Modes, each a fresh cluster:
  off    --no-prefix-cache
  on     the prefix cache, with the default device pool (larger than the working set)
  small  the prefix cache with a device pool (--kv-budget-mb) smaller than the working set
  host   small, plus a host tier (--host-cache-mb) smaller than the working set; skipped with
         a message when the workers have no --host-cache-mb
The working set is measured by the first `on` run (the pages its cache inserted), and sizes
`small` (a fraction of it, but room for the requests in flight) and `host`, unless given.

Each fresh cluster first serves two warm-up requests on an unrelated prompt, the second
continuing the first (so prefill over cached context runs too): a new process compiles its
Triton kernels on first use, which would otherwise land in the measured TTFT p99 on a GPU.
Neither is measured, and the cache counters are read after them.

Reported per run: client TTFT p50/p99, requests/s and prompt tokens/s (over the run's wall
time), and hit rates from the workers' /metrics (pdserve_prefix_cache_*: hit tokens over
looked-up tokens; the host tier's share), with TTFT p50 and throughput ratios vs `off`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.serving.chat_workload import (  # noqa: E402
    RunResult,
    Workload,
    drive,
    make_workload,
    warm_up,
)
from benchmarks.serving.launched import Pdserve  # noqa: E402
from pdserve.bench.metrics import percentile  # noqa: E402

METRICS_TIMEOUT_S = 10.0
COUNTERS = ("queries_tokens", "hit_tokens", "host_hit_tokens", "inserted_pages", "evicted_pages")


# -- the cluster ------------------------------------------------------------------------------
class Cluster(Pdserve):
    """`pdserve launch ARGS`: up once it prints READY URL; every process it started is stopped
    by pid on exit, also when the run failed (benchmarks/serving/launched.py)."""

    def __init__(self, args: list[str], log_dir: Path) -> None:
        super().__init__(["launch", *args], log_dir)
        self.workers: list[str] = []

    def _start(self) -> None:
        super()._start()
        self.workers = [p["url"] for p in self.table() if p["name"] != "router"]

    def info(self, worker: str) -> dict[str, Any]:
        """A worker's GET /info, which needs the cluster's key (launch wrote it in the log dir)."""
        from pdserve.runtime.cluster_key import ClusterKey

        key = ClusterKey.load(self.log_dir / "cluster.key")
        return dict(json.loads(get(worker + "/info", key.http_headers)))


def get(url: str, headers: dict[str, str] | None = None) -> str:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=METRICS_TIMEOUT_S) as r:
        return str(r.read().decode())


def cache_counters(workers: list[str]) -> dict[str, float]:
    """pdserve_prefix_cache_<name>_total summed over the workers (absent counters are 0)."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for w in workers:
        for line in get(w + "/metrics").splitlines():
            for name in COUNTERS:
                if line.startswith(f"pdserve_prefix_cache_{name}_total "):
                    out[name] += float(line.split()[-1])
    return out


# -- one configuration ------------------------------------------------------------------------
TOPOLOGIES = {  # launch flags, router policy included
    "colocated": ["--prefill", "0", "--decode", "1", "--policy", "prefix"],
    "pd": ["--prefill", "1", "--decode", "1", "--policy", "prefix"],
    "colocated2": ["--prefill", "0", "--decode", "2", "--policy", "prefix"],
    "colocated2-lo": ["--prefill", "0", "--decode", "2", "--policy", "least-outstanding"],
}
DEFAULT_TOPOLOGIES = ["colocated", "pd"]
MODES = ("off", "on", "small", "host")


@dataclass
class Sizes:
    working_set_mb: float | None = None  # measured by the first `on` run
    page_bytes: int = 0
    live_mb: float = 0.0  # the pages the requests in flight need at once


def mode_flags(mode: str, args: argparse.Namespace, sizes: Sizes) -> list[str] | None:
    """The engine flags of `mode`; None (with a message) when it cannot run."""
    if mode == "off":
        return ["--no-prefix-cache"]
    if mode == "on":
        return []
    if sizes.working_set_mb is None and (args.small_kv_mb is None or args.host_cache_mb is None):
        print(f"skipping {mode}: run `on` first or give --small-kv-mb and --host-cache-mb")
        return None
    ws = sizes.working_set_mb or 0.0
    small = args.small_kv_mb or max(1.25 * sizes.live_mb, 0.4 * ws)
    flags = ["--kv-budget-mb", f"{small:.1f}"]
    if ws and small >= ws:
        print(f"note: the small pool ({small:.0f} MB) is not below the working set ({ws:.0f} MB)")
    if mode == "small":
        return flags
    if not has_host_tier():
        print("skipping host: the workers have no --host-cache-mb (issue 15 part 2 not landed)")
        return None
    host = args.host_cache_mb or 0.6 * ws
    return [*flags, "--host-cache-mb", f"{host:.1f}"]


def has_host_tier() -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return "--host-cache-mb" in out.stdout


def run_config(
    topology: str, mode: str, args: argparse.Namespace, work: Workload, sizes: Sizes, out: Path
) -> tuple[RunResult, list[str]] | None:
    """One fresh cluster, the whole workload, the cache counters: the result and its flags."""
    flags = mode_flags(mode, args, sizes)
    if flags is None:
        return None
    launch = [*TOPOLOGIES[topology], "--model", args.model]
    launch += ["--device", args.device, "--max-model-len", str(args.max_model_len), *flags]
    print(f"{topology}/{mode}: pdserve launch {' '.join(launch)}", file=sys.stderr)
    with Cluster(launch, out / f"{topology}-{mode}") as cluster:
        asyncio.run(warm_up(cluster.url, args))
        before = cache_counters(cluster.workers)
        result = asyncio.run(drive(cluster.url, work, args))
        after = cache_counters(cluster.workers)
        result.cache = {k: after[k] - before[k] for k in COUNTERS}
        if mode == "on" and sizes.working_set_mb is None and not result.cache["evicted_pages"]:
            measure_sizes(sizes, cluster.info(cluster.workers[0]), result, args)
    return result, flags


def measure_sizes(
    sizes: Sizes, info: dict[str, Any], result: RunResult, args: argparse.Namespace
) -> None:
    """The working set (every page the cache inserted, none evicted) and the pages the
    requests in flight need at once (--concurrency of the longest prompt and its answer);
    `info`: a cache-holding worker's /info."""
    from pdserve.kvcache.layout import KVLayout

    layout = info["layout"]
    sizes.page_bytes = KVLayout.from_dict(layout).page_bytes
    sizes.working_set_mb = result.cache["inserted_pages"] * sizes.page_bytes / 2**20
    longest = max((t.prompt_tokens for t in result.turns), default=0)
    pages = math.ceil((longest + args.output_tokens) / int(layout["page_size"]))
    sizes.live_mb = args.concurrency * pages * sizes.page_bytes / 2**20
    print(
        f"working set {sizes.working_set_mb:.1f} MB; requests in flight need at most "
        f"{sizes.live_mb:.1f} MB",
        file=sys.stderr,
    )


# -- the report -------------------------------------------------------------------------------
def summary(r: RunResult) -> dict[str, float]:
    ok = [t for t in r.turns if t.error is None and t.ttft is not None]
    ttft = [t.ttft * 1e3 for t in ok if t.ttft is not None]
    c = r.cache
    looked = c.get("queries_tokens", 0.0)
    return {
        "requests": len(ok),
        "errors": len(r.turns) - len(ok),
        "ttft_p50": percentile(ttft, 50) if ttft else math.nan,
        "ttft_p99": percentile(ttft, 99) if ttft else math.nan,
        "req_s": len(ok) / r.duration_s if r.duration_s else math.nan,
        "prompt_tok_s": sum(t.prompt_tokens for t in ok) / r.duration_s if r.duration_s else 0,
        "hit": c.get("hit_tokens", 0.0) / looked if looked else 0.0,
        "host_hit": c.get("host_hit_tokens", 0.0) / looked if looked else 0.0,
        "evicted": c.get("evicted_pages", 0.0),
    }


HEADER = (
    "| topology | mode | flags | requests (errors) | TTFT p50 (ms) | TTFT p99 (ms) | req/s "
    "| prompt tok/s | hit rate (host) | evicted pages | TTFT p50 vs off | req/s vs off "
    "| hits vs on |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def row(
    topology: str,
    mode: str,
    flags: str,
    s: dict[str, float],
    off: dict[str, float],
    on: dict[str, float],
) -> str:
    """One table row; the ratios are to the same topology's `off` and `on` runs."""

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "-"

    cells = [
        topology,
        mode,
        flags or "(defaults)",
        f"{s['requests']:.0f} ({s['errors']:.0f})",
        f"{s['ttft_p50']:.0f}",
        f"{s['ttft_p99']:.0f}",
        f"{s['req_s']:.2f}",
        f"{s['prompt_tok_s']:.0f}",
        f"{100 * s['hit']:.0f}% ({100 * s['host_hit']:.0f}%)",
        f"{s['evicted']:.0f}",
        ratio(s["ttft_p50"], off.get("ttft_p50", math.nan)),
        ratio(s["req_s"], off.get("req_s", math.nan)),
        ratio(s["hit"], on.get("hit", math.nan)),
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--topologies", nargs="+", default=DEFAULT_TOPOLOGIES, choices=list(TOPOLOGIES))
    p.add_argument("--modes", nargs="+", default=["on", "off", "small", "host"], choices=MODES)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--user-tokens", type=int, default=100)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--small-kv-mb", type=float, default=None, help="small/host: device pool")
    p.add_argument("--host-cache-mb", type=float, default=None, help="host: the host tier")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None, help="logs and the JSON summary (default: temp)")
    args = p.parse_args()
    # SIGTERM unwinds like Ctrl-C, so every cluster's __exit__ stops its processes by pid.
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    from pdserve.model.builtin import resolve_model
    from pdserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(Path(resolve_model(args.model)))
    work = make_workload(args, tokenizer)
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="prefix-bench-"))
    print(f"out {out}; {os.cpu_count()} CPUs; {' '.join(sys.argv)}", file=sys.stderr)
    sizes = Sizes()
    rows: list[tuple[str, str, str, dict[str, float]]] = []
    for topology in args.topologies:
        for mode in args.modes:
            ran = run_config(topology, mode, args, work, sizes, out)
            if ran is None:
                continue
            result, flags = ran
            s = summary(result)
            rows.append((topology, mode, " ".join(flags), s))
            print(row(topology, mode, " ".join(flags), s, {}, {}), file=sys.stderr)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    print(HEADER)
    for topology, mode, shown, s in rows:
        off: dict[str, float] = {}
        on: dict[str, float] = {}
        for other in rows:
            if other[0] == topology:
                off = other[3] if other[1] == "off" else off
                on = other[3] if other[1] == "on" else on
        print(row(topology, mode, shown, s, off, on))
    return 0


if __name__ == "__main__":
    sys.exit(main())
