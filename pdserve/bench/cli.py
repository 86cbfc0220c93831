"""`pdserve bench`: flags -> BenchConfig -> one run -> table on stdout, JSON and plot files.

Exit status: 0 when the run ended with at most --max-failure-rate of its requests failed
(default 0: none), 1 when more failed (the reason goes to stderr, after the report and its
files: failures are results too, counted by kind), 2 for a usage error. A script or CI job
that runs bench against a server that failed every request must not read a success.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any

from pdserve.bench.config import (
    DATASETS,
    ENDPOINTS,
    ArrivalConfig,
    BenchConfig,
    ClientConfig,
    DatasetConfig,
    Slo,
)
from pdserve.runtime import evloop


def add_bench_command(sub: Any) -> None:
    """Register `bench` on the subparsers object of `pdserve`'s top-level parser."""
    p: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server (streaming; TTFT, ITL, goodput)",
        description="Load-test an OpenAI-compatible server with streamed requests: latency "
        "percentiles (TTFT, TPOT, ITL, end to end), throughput and goodput.\n\n"
        "exit status: 0 the run ended with at most --max-failure-rate of its requests "
        "failed; 1 more failed (the report is still printed and written); 2 a usage error.",
    )
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--endpoint",
        default="completions",
        choices=sorted(ENDPOINTS),
        help="/v1/completions or /v1/chat/completions",
    )
    p.add_argument("--model", default=None, help="model name to send (default: /v1/models)")
    p.add_argument(
        "--max-failure-rate",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="exit 1 when more than this fraction of the requests failed (0: any failure; "
        "1: never)",
    )
    d = p.add_argument_group("dataset")
    d.add_argument(
        "--dataset",
        default="random",
        choices=DATASETS,
        help="random lengths, recorded ShareGPT chats, or groups sharing a system prompt",
    )
    d.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (default: none)")
    d.add_argument("--num-prompts", type=int, default=100, help="requests to send and record")
    d.add_argument("--input-len", type=int, default=256, help="random: prompt tokens")
    d.add_argument(
        "--output-len", type=int, default=128, help="random, shared-prefix: output tokens"
    )
    d.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in [len*(1-r), len*(1+r)]",
    )
    d.add_argument(
        "--prompt-format",
        default="auto",
        choices=["auto", "ids", "text"],
        help="auto: token ids for completions, text for chat and ShareGPT",
    )
    d.add_argument(
        "--tokenizer",
        default=None,
        help="builtin:NAME or a model dir: exact text lengths, ids from its vocab "
        "(default: none: ids from 100 to 4000, one common word a token)",
    )
    d.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="fixed output length (default: the recorded answer's)",
    )
    d.add_argument(
        "--sp-prompts-per-group",
        type=int,
        default=8,
        help="shared-prefix: prompts per shared system prompt",
    )
    d.add_argument(
        "--sp-system-len", type=int, default=1024, help="shared-prefix: shared prefix tokens"
    )
    d.add_argument(
        "--sp-question-len", type=int, default=64, help="shared-prefix: tokens after the prefix"
    )
    a = p.add_argument_group("arrivals")
    a.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s, Poisson-like (default inf: all at once)",
    )
    a.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 Poisson, <1 burstier, >1 steadier",
    )
    a.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="cap on requests in flight (default: none)",
    )
    p.add_argument("--warmup", type=int, default=1, help="unrecorded requests sent first")
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="client processes sharing the run (requests, concurrency and rate dealt evenly): "
        "one reads ~20,000 SSE events/s, so high concurrency at fast decode steps needs "
        "several for the client not to set the ITL it reports (default: 1)",
    )
    p.add_argument("--seed", type=int, default=0, help="of the prompts and the arrival times")
    p.add_argument(
        "--slo",
        nargs="+",
        default=[],
        metavar="KEY:MS",
        help="goodput objectives: ttft:MS tpot:MS e2el:MS (default: none, no goodput)",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (outputs may end before --output-len)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="write summary + per-request records (JSON) (default: table on stdout only)",
    )
    p.add_argument(
        "--plot",
        default=None,
        help="write latency CDFs and throughput (PNG) (default: no plot)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.add_argument(
        "--api-key", default=None, help="the server's API key (default: $PDSERVE_API_KEY)"
    )
    p.set_defaults(func=cmd_bench)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    fmt = args.prompt_format
    if fmt == "auto":
        text = args.endpoint == "chat" or (args.dataset == "sharegpt" and not args.tokenizer)
        fmt = "text" if text else "ids"
    return BenchConfig(
        client=ClientConfig(
            url=args.url,
            endpoint=args.endpoint,
            model=args.model,
            ignore_eos=not args.no_ignore_eos,
            request_timeout_s=args.request_timeout,
            api_key=args.api_key or os.environ.get("PDSERVE_API_KEY") or None,
        ),
        dataset=DatasetConfig(
            name=args.dataset,
            num_prompts=args.num_prompts,
            seed=args.seed,
            prompt_format=fmt,
            tokenizer=args.tokenizer,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            path=args.dataset_path,
            sharegpt_output_len=args.sharegpt_output_len,
            sp_prompts_per_group=args.sp_prompts_per_group,
            sp_system_len=args.sp_system_len,
            sp_question_len=args.sp_question_len,
        ),
        arrival=ArrivalConfig(args.request_rate, args.burstiness, args.max_concurrency),
        slo=Slo.parse(args.slo),
        warmup=args.warmup,
        progress=not args.no_progress,
        max_failure_rate=args.max_failure_rate,
    )


def _raise_fd_limit(wanted: int) -> None:
    # Every request in flight holds a socket; the usual soft limit of 1024 would turn a
    # large all-at-once run into connection errors that are the client's, not the server's.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def cmd_bench(args: argparse.Namespace) -> int:
    from pdserve.bench.dataset import load_tokenizer, make_requests
    from pdserve.bench.metrics import too_many_failures
    from pdserve.bench.pd_routing import format_pd, pd_block, scrape
    from pdserve.bench.report import format_summary, write_json
    from pdserve.bench.runner import Workload, run_workloads

    cfg = config_from_args(args)
    tokenizer = load_tokenizer(cfg.dataset.tokenizer) if cfg.dataset.tokenizer else None
    requests = make_requests(cfg.dataset, tokenizer)
    _raise_fd_limit(len(requests) + cfg.warmup + 256)
    before = scrape(cfg.client.url, cfg.client.headers)  # the router's routed-request counts
    if args.processes != 1:
        from pdserve.bench.fanout import run_processes

        try:
            result = run_processes(
                cfg.client, requests, cfg.arrival, cfg.slo, cfg.warmup, cfg.dataset.seed,
                args.processes,
            )  # fmt: skip
        except RuntimeError as e:  # a client process failed: no run to report
            print(f"pdserve bench: {e}", file=sys.stderr)
            return 1
    else:
        workload = Workload("main", requests, cfg.arrival, seed=cfg.dataset.seed)
        result = evloop.run(
            run_workloads(cfg.client, [workload], cfg.slo, cfg.warmup, cfg.progress)
        )
    result.pd = pd_block(before, scrape(cfg.client.url, cfg.client.headers), cfg.warmup)
    # Files first: a reader that closes our stdout early (| head) must not cost the records.
    if args.out:
        config = {"argv": sys.argv[1:], **dataclasses.asdict(cfg)}
        write_json(Path(args.out), config, result)
        print(f"wrote {args.out}", file=sys.stderr)
    if args.plot:
        from pdserve.bench.plot import plot_run

        plot_run(result.records, Path(args.plot), title=f"pdserve bench {cfg.client.url}")
        print(f"wrote {args.plot}", file=sys.stderr)
    print(format_summary(result.summary), flush=True)
    if result.pd is not None:
        print(format_pd(result.pd), flush=True)
    why = too_many_failures(result.summary, cfg.max_failure_rate)
    if why is not None:
        print(f"pdserve bench: exit 1: {why}", file=sys.stderr)
        return 1
    return 0
