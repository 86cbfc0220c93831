"""`pdserve`: serve, launch, router, bench, chaos, doctor, keygen, make-model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdserve.bench.cli import add_bench_command
from pdserve.chaos.cli import add_chaos_command
from pdserve.config import (
    BACKENDS,
    CacheConfig,
    EngineConfig,
    ModelSpec,
    SchedulerConfig,
    ServerConfig,
    resolve_device,
)
from pdserve.doctor.cli import add_doctor_command
from pdserve.launch import add_launch_command
from pdserve.router.cli import add_front_end_args, add_router_command
from pdserve.runtime import logs


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument(
        "--model",
        default="builtin:tiny",
        help="builtin:NAME or a local Hugging Face model directory",
    )
    g.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto = the checkpoint's torch_dtype",
    )
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--kv-budget-mb", type=float, default=256.0, help="memory for the KV pool")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--max-batched-tokens", type=int, default=512, help="token budget per step")
    g.add_argument("--max-running", type=int, default=64, help="cap on running requests")
    g.add_argument("--max-model-len", type=int, default=4096, help="cap on prompt + output")
    g.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may live before it is failed",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from pdserve.model.builtin import resolve_model
    from pdserve.model.config import ModelArch

    path = resolve_model(args.model)
    dtype = args.dtype
    if dtype == "auto":
        dtype = ModelArch.from_dir(path).torch_dtype
        dtype = dtype if dtype in ("float32", "bfloat16", "float16") else "float32"
    return EngineConfig(
        model=ModelSpec(
            path=str(path),
            name=args.served_model_name or args.model,
            dtype=dtype,
            device=resolve_device(args.device),
        ),
        cache=CacheConfig(page_size=args.page_size, kv_budget_bytes=int(args.kv_budget_mb * 2**20)),
        scheduler=SchedulerConfig(
            max_batched_tokens=args.max_batched_tokens,
            max_running=args.max_running,
            max_model_len=args.max_model_len,
        ),
        request_timeout_s=args.request_timeout,
    )


def cmd_make_model(args: argparse.Namespace) -> int:
    from pdserve.model.builtin import make_model

    out = make_model(args.name, Path(args.out))
    print(f"wrote {args.name} to {out}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.server.app import run_server
    from pdserve.server.auth import load_api_key

    if args.backend == "nixl" and args.role == "decode":
        from pdserve.transfer.nixl import INSTALL_HINT, nixl_available

        if not nixl_available():
            print(f"pdserve serve: --backend nixl needs NIXL: {INSTALL_HINT}", file=sys.stderr)
            return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg = ServerConfig(
        engine=engine_config(args),
        host=args.host,
        port=args.port,
        role=args.role,
        control_port=args.control_port,
        backend=args.backend,
        debug_faults=args.debug_faults,
        cluster_key_file=args.cluster_key_file,
        api_key=load_api_key(args.api_key, args.api_key_file),
        protect_health=args.protect_health,
        max_queue=args.max_queue,
    )
    from pdserve.transfer.nixl import BackendUnavailable

    try:
        return run_server(cfg)
    except BackendUnavailable as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2


def cmd_keygen(args: argparse.Namespace) -> int:
    from pdserve.runtime.cluster_key import ClusterKey, generate

    if args.token_of:  # for curl: -H "Authorization: Bearer $(pdserve keygen --token-of F)"
        print(ClusterKey.load(args.token_of).http_token)
        return 0
    try:
        generate(args.out)
    except FileExistsError:
        print(f"pdserve keygen: {args.out} exists; not overwriting a key", file=sys.stderr)
        return 2
    print(f"wrote a new cluster key to {args.out} (mode 600); give it to every worker and router")
    return 0


def add_key_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster-key-file",
        default=None,
        metavar="FILE",
        help="the cluster's shared secret (default: $PDSERVE_CLUSTER_KEY_FILE); "
        "prefill and decode workers need it",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    p.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="log level of every process (default: INFO)",
    )
    sub = p.add_subparsers(dest="command", required=True)

    mk = sub.add_parser("make-model", help="write a built-in model as an HF directory")
    mk.add_argument("name", help="tiny | qwen2-tiny | qwen3-tiny | qwen2-0.5b-shape")
    mk.add_argument("--out", required=True, help="output directory")
    mk.set_defaults(func=cmd_make_model)

    kg = sub.add_parser("keygen", help="write a new cluster key (for workers started by hand)")
    what = kg.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", help="the key file to create (mode 600)")
    what.add_argument(
        "--token-of", metavar="FILE", help="print the HTTP bearer token of an existing key file"
    )
    kg.set_defaults(func=cmd_keygen)

    sv = sub.add_parser("serve", help="serve a model over the OpenAI API")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    sv.add_argument("--role", default="colocated", choices=["colocated", "prefill", "decode"])
    sv.add_argument(
        "--control-port",
        type=int,
        default=0,
        help="prefill role: ZMQ control port (0 picks a free one)",
    )
    sv.add_argument(
        "--backend",
        default="shm",
        choices=BACKENDS,
        help="KV transfer data plane for prefill/decode roles (nixl: pip install 'pdserve[nixl]')",
    )
    sv.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    sv.add_argument(
        "--debug-faults",
        action="store_true",
        help="let POST /debug/faults set fault points at run time (tests and chaos only)",
    )
    add_key_arg(sv)
    add_front_end_args(sv)
    add_engine_args(sv)
    sv.set_defaults(func=cmd_serve)
    add_router_command(sub)
    add_launch_command(sub)
    add_bench_command(sub)
    add_chaos_command(sub)
    add_doctor_command(sub)
    return p


def raise_fd_limit(want: int = 65536) -> None:
    """Let a server hold many connections: the soft descriptor limit up to the hard one (a
    flood of connections then meets --max-queue and timeouts, not EMFILE in accept)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(args.log_level)
    if args.command in ("serve", "router", "launch"):
        raise_fd_limit()
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
