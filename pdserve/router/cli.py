"""`pdserve router`: the OpenAI API in front of prefill/decode (or co-located) workers."""

from __future__ import annotations

import argparse
from typing import Any

from pdserve.config import FrontendConfig, HttpLimits
from pdserve.frontend.tool_calls.chooser import AUTO, PARSERS
from pdserve.router.config import WORKER_STREAMS
from pdserve.router.policy import POLICIES
from pdserve.router.prefix_index import DEFAULT_CAPACITY_PAGES


def add_front_end_args(p: argparse.ArgumentParser) -> None:
    """The clients' key, for `router` and `serve` (co-located): see pdserve/server/auth.py."""
    g = p.add_argument_group("client authentication")
    g.add_argument(
        "--api-key",
        default=None,
        help="clients must send Authorization: Bearer KEY on /v1/* (default: $PDSERVE_API_KEY)",
    )
    g.add_argument(
        "--api-key-file",
        default=None,
        help="read the API key from this file's first line (default: --api-key)",
    )
    g.add_argument(
        "--protect-health",
        action="store_true",
        help="/health and /metrics need a key too (default: open, for probes and Prometheus)",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=4096,
        help="completion calls in flight at most; past it 429 with Retry-After (default: 4096)",
    )


def add_unknown_fields_arg(p: argparse.ArgumentParser) -> None:
    """What the OpenAI API does with a request field it does not know (frontend/fields.py),
    for `serve` and `router`."""
    p.add_argument(
        "--reject-unknown-fields",
        action="store_true",
        help="answer 400 naming a request field pdserve does not know (default: ignore it "
        "and log one warning per field name, as vLLM does)",
    )


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """How the OpenAI API treats a chat's tools and its own template (config.FrontendConfig),
    for `serve`, `router` and `launch` (whose router parses the requests)."""
    g = p.add_argument_group("chat")
    g.add_argument(
        "--tool-call-parser",
        default=AUTO,
        choices=(AUTO, *sorted(PARSERS)),
        metavar="NAME|auto",
        help="how the model writes tool calls: "
        f"{', '.join(sorted(PARSERS))}; auto: as its chat template shows them (a template "
        "that shows none: requests asking for tool calls are refused) (default: auto)",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a request's own chat_template (sandboxed, in a helper process with time "
        "and memory bounds); off: such a request is refused with a 400",
    )


def frontend_config(args: argparse.Namespace) -> FrontendConfig:
    return FrontendConfig(
        tool_call_parser=args.tool_call_parser,
        trust_request_chat_template=args.trust_request_chat_template,
    )


def add_http_args(p: argparse.ArgumentParser) -> None:
    """The HTTP server's connection limits and drain time, for `serve` and `router`."""
    g = p.add_argument_group("HTTP connections")
    g.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections at most; past it 503 with Retry-After "
        "(default: 8192, fewer under a low descriptor limit)",
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        help="seconds an idle connection stays open",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a request head may take after its first byte (slow clients are cut off)",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        help="on Ctrl-C, seconds running requests may finish (a second Ctrl-C stops at once)",
    )


def http_limits(args: argparse.Namespace) -> HttpLimits:
    return HttpLimits(
        max_connections=args.max_connections,
        idle_timeout_s=args.keep_alive_timeout,
        header_timeout_s=args.header_timeout,
    )


def add_prefix_policy_args(p: argparse.ArgumentParser) -> None:
    """`--policy prefix`'s settings (router/policy.py), for `router` and `launch`."""
    p.add_argument(
        "--prefix-index-pages",
        type=int,
        default=DEFAULT_CAPACITY_PAGES,
        metavar="N",
        help="--policy prefix: pages of prompts remembered per worker, least recent out "
        f"first (default: {DEFAULT_CAPACITY_PAGES})",
    )
    p.add_argument(
        "--prefix-max-imbalance",
        type=int,
        default=8,
        metavar="N",
        help="--policy prefix: the worker with the longest match loses to the least loaded "
        "one when it has more than N more requests in flight (default: 8)",
    )


def add_worker_streams_arg(p: argparse.ArgumentParser) -> None:
    """How outputs come back from the workers (router/channel.py), for `router` and `launch`."""
    p.add_argument(
        "--worker-streams",
        default="shared",
        choices=WORKER_STREAMS,
        help="shared: one output stream per worker carries every request's tokens (one write "
        "per engine step on the worker); per-request: one /generate stream per request "
        "(default: shared)",
    )


def add_processes_arg(p: argparse.ArgumentParser, flag: str) -> None:
    """How many router processes serve the port (router/pool.py), for `router` and `launch`."""
    p.add_argument(
        flag,
        type=int,
        default=None,
        metavar="N",
        help="router processes sharing the port: one streams ~20,000 chunks/s, so high "
        "concurrency at fast decode steps needs several (default: 1; launch on CUDA: 4, at "
        "most a quarter of the CPUs)",
    )


def add_router_command(sub: Any) -> None:
    """Register `router` on the subparsers object of `pdserve`'s top-level parser."""
    r: argparse.ArgumentParser = sub.add_parser(
        "router",
        help="route the OpenAI API over prefill/decode or co-located workers",
        description="The OpenAI API in front of prefill/decode workers (or co-located ones): "
        "the tokenizer, the worker registry, health checks and the choice of a worker per "
        "request.",
    )
    r.add_argument(
        "--prefill",
        nargs="+",
        default=[],
        metavar="URL",
        help="prefill worker URLs (default: none, and the --decode workers are co-located)",
    )
    r.add_argument(
        "--decode",
        nargs="+",
        required=True,
        metavar="URL",
        help="decode worker URLs, or co-located worker URLs without --prefill",
    )
    r.add_argument("--host", default="127.0.0.1", help="address to listen on")
    r.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    add_processes_arg(r, "--processes")
    r.add_argument(
        "--reuse-port",
        action="store_true",
        help="bind with SO_REUSEPORT, so that several routers of this user share the port "
        "(what --processes does for its own)",
    )
    r.add_argument(
        "--policy",
        default="least-outstanding",
        choices=sorted(POLICIES),
        help="how a worker is chosen: the fewest requests in flight, in turn, or prefix: "
        "where the prompt's longest prefix should be cached, balanced against load",
    )
    add_prefix_policy_args(r)
    add_worker_streams_arg(r)
    r.add_argument(
        "--model",
        required=True,
        help="builtin:NAME, a local model directory or .gguf file (the router needs its tokenizer)",
    )
    r.add_argument(
        "--served-model-name",
        default=None,
        help="name clients use (default: the workers' model name)",
    )
    r.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may live when the client gives no timeout",
    )
    r.add_argument(
        "--startup-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for every worker's /info at startup",
    )
    r.add_argument(
        "--cluster-key-file",
        default=None,
        metavar="FILE",
        help="the workers' cluster key (default: $PDSERVE_CLUSTER_KEY_FILE)",
    )
    add_front_end_args(r)
    add_unknown_fields_arg(r)
    add_chat_args(r)
    add_http_args(r)
    r.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    # Imported here so that `pdserve --help` does not pay for aiohttp and the tokenizer.
    from pdserve.frontend.fields import reject_unknown_fields
    from pdserve.router.app import run_router
    from pdserve.router.config import RouterConfig
    from pdserve.router.pool import MAX_PROCESSES, run_pool
    from pdserve.server.auth import load_api_key

    # A model directory (what `pdserve launch` passes) is read as it is. Only a builtin: name
    # imports model.builtin, which loads torch (to build the model); the router never does.
    model_path = args.model
    if model_path.startswith("builtin:"):
        from pdserve.model.builtin import resolve_model

        model_path = str(resolve_model(model_path))
    cfg = RouterConfig(
        decode_urls=tuple(u.rstrip("/") for u in args.decode),
        prefill_urls=tuple(u.rstrip("/") for u in args.prefill),
        model_path=model_path,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        policy=args.policy,
        worker_streams=args.worker_streams,
        prefix_index_pages=args.prefix_index_pages,
        prefix_max_imbalance=args.prefix_max_imbalance,
        request_timeout_s=args.request_timeout,
        startup_timeout_s=args.startup_timeout,
        cluster_key_file=args.cluster_key_file,
        api_key=load_api_key(args.api_key, args.api_key_file),
        protect_health=args.protect_health,
        max_queue=args.max_queue,
        http=http_limits(args),
        drain_timeout_s=args.drain_timeout,
        reuse_port=args.reuse_port,
        frontend=frontend_config(args),
    )
    if args.processes is None:
        args.processes = 1
    if not 1 <= args.processes <= MAX_PROCESSES:
        raise ValueError(f"--processes must be in [1, {MAX_PROCESSES}], got {args.processes}")
    if args.processes > 1:
        return run_pool(cfg, args.argv, args.processes)
    reject_unknown_fields(args.reject_unknown_fields)
    return run_router(cfg)
