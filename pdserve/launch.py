"""`pdserve launch`: start prefill/decode (or co-located) workers and a router on this machine.

The command line only: it resolves the model once (the children share its directory), the
thread count and the log directory, rebuilds the engine flags for the workers, and hands a
LaunchConfig to the Launcher (runtime/launcher.py), which owns the processes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from pdserve.config import BACKENDS


def engine_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The engine flags of `serve` as given to `launch`, turned back into argv."""
    from pdserve.engine_flags import add_engine_args

    probe = argparse.ArgumentParser(add_help=False)
    add_engine_args(probe)
    argv: list[str] = []
    negatable = {a.dest for a in probe._actions if isinstance(a, argparse.BooleanOptionalAction)}
    for dest in vars(probe.parse_args([])):
        value = getattr(args, dest)
        flag = "--" + dest.replace("_", "-")
        if value is False and dest in negatable:  # --no-<flag>: off, not the default
            argv.append("--no-" + dest.replace("_", "-"))
            continue
        if dest in ("model", "served_model_name") or value is None or value is False:
            continue
        argv += [flag] if value is True else [flag, str(value)]
    # The flags are rebuilt by naming convention; refuse to pass on anything that does not
    # parse back to the same values.
    back = vars(probe.parse_args(argv))
    wrong = [
        k
        for k, v in back.items()
        if k not in ("model", "served_model_name") and v != getattr(args, k)
    ]
    if wrong:
        raise RuntimeError(f"launch cannot pass engine flags {wrong} on to its workers")
    return tuple(argv)


def add_launch_command(sub: Any) -> None:
    """Register `launch` on the subparsers object of `pdserve`'s top-level parser."""
    from pdserve.engine_flags import add_engine_args
    from pdserve.router.cli import (
        add_chat_args,
        add_front_end_args,
        add_prefix_policy_args,
        add_processes_arg,
        add_unknown_fields_arg,
        add_worker_streams_arg,
    )
    from pdserve.router.policy import POLICIES

    p: argparse.ArgumentParser = sub.add_parser(
        "launch",
        help="start prefill/decode workers and a router on this machine",
        description="Start prefill and decode workers (or co-located ones, --prefill 0) and "
        "a router on this machine, watch them, and stop them all on Ctrl-C or when one "
        "dies (--on-worker-exit).",
    )
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (0: co-located)")
    p.add_argument("--decode", type=int, default=1, help="decode (or co-located) workers")
    p.add_argument("--host", default="127.0.0.1", help="the router's address")
    p.add_argument("--port", type=int, default=8000, help="the router's port (0: a free one)")
    add_processes_arg(p, "--router-processes")
    p.add_argument(
        "--backend",
        default="auto",
        choices=("auto", *BACKENDS),
        help="KV data plane (auto: shm on CPU, nixl on a GPU, tcp without NIXL)",
    )
    p.add_argument(
        "--policy",
        default="least-outstanding",
        choices=sorted(POLICIES),
        help="the router's choice of worker: the fewest requests in flight, in turn, or "
        "prefix (where the prompt's prefix should be cached, balanced against load)",
    )
    add_prefix_policy_args(p)
    add_worker_streams_arg(p)
    add_unknown_fields_arg(p)  # the router's: it parses the OpenAI requests
    add_chat_args(p)  # the router's too
    p.add_argument(
        "--debug-faults",
        action="store_true",
        help="every worker: let POST /debug/faults set fault points at run time",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per worker (0: this machine's CPUs / number of workers)",
    )
    p.add_argument(
        "--prefill-threads",
        type=int,
        default=0,
        help="torch threads per prefill worker (0: --threads)",
    )
    p.add_argument(
        "--decode-threads",
        type=int,
        default=0,
        help="torch threads per decode (or co-located) worker (0: --threads)",
    )
    for side in ("prefill", "decode"):
        p.add_argument(
            f"--{side}-tp",
            type=int,
            default=0,
            help=f"tensor-parallel ranks per {side} worker (0: --tp); the two sides may differ "
            "(KV moves as the whole model's pages over shm or tcp, on the CPU)",
        )
    p.add_argument(
        "--gpus",
        default="auto",
        metavar="auto|none|LIST",
        help="GPUs to spread the workers over, round-robin, prefill first: each sees only its "
        "own (CUDA_VISIBLE_DEVICES); auto: every visible GPU when there are several",
    )
    p.add_argument(
        "--mps",
        action="store_true",
        help="run the workers under the cluster's own CUDA MPS daemon (nvidia-cuda-mps-control, "
        "its pipe in the log dir): workers sharing a GPU run their kernels side by side rather "
        "than in time slices (1P+1D on one GPU)",
    )
    p.add_argument("--log-dir", default=None, help="per-process logs (default: a temp dir)")
    add_front_end_args(p)
    p.add_argument(
        "--cluster-key-file",
        default=None,
        metavar="FILE",
        help="the cluster's shared secret (default: a new one, LOG_DIR/cluster.key, mode 600); "
        "while the cluster runs, a copy only you can read lets `pdserve doctor --url` and "
        "`pdserve chaos --url` find it from the router's address",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        help="seconds for every process to print READY",
    )
    p.add_argument(
        "--on-worker-exit",
        default="stop",
        choices=["stop", "continue"],
        help="a worker died: stop the cluster, or let the router route around it",
    )
    add_engine_args(p)
    p.set_defaults(func=cmd_launch)


def launch_backend(args: argparse.Namespace) -> str | None:
    """The data plane every decode worker will register (`auto` resolved for the device the
    workers will use); None, after saying why, when it cannot work here."""
    from pdserve.config import resolve_device
    from pdserve.transfer.receiver import resolve_backend

    try:
        device = resolve_device(args.device) if args.prefill else "cpu"  # co-located: unused
    except ValueError as e:
        print(f"pdserve launch: {e}", file=sys.stderr)
        return None
    backend, why = resolve_backend(args.backend, device, moves_kv=args.prefill > 0)
    if why is not None:
        print(f"pdserve launch: {why}", file=sys.stderr)
        return None
    return backend


def launch_gpus(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The GPUs the workers are spread over (runtime/gpus.py); None after printing why not."""
    from pdserve.runtime.gpus import resolve_gpus

    count = 0  # torch is imported (seconds) only when placement may apply
    if args.gpus.strip() != "none" and (args.device.startswith("cuda") or args.device == "auto"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        return resolve_gpus(args.gpus, args.device, os.environ.get("CUDA_VISIBLE_DEVICES"), count)
    except ValueError as e:
        print(f"pdserve launch: {e}", file=sys.stderr)
        return None


# Router processes `launch` starts on CUDA unless told: one event loop streams ~20,000 chunks/s,
# which a GPU at concurrency 128 outruns (benchmarks/RESULTS.md, 2026-12-06 later: with four,
# every chunk carries one token and co-located serves 36% more).
CUDA_ROUTER_PROCESSES = 4


def router_processes(device: str, cpus: int) -> int:
    """`--router-processes` when not given: CUDA_ROUTER_PROCESSES on CUDA (at most a quarter of
    the CPUs, which the workers' engines and the clients need too), else 1."""
    if device == "auto":  # torch says (launch_gpus has set "cuda" where it placed workers)
        from pdserve.config import resolve_device

        device = resolve_device(device)
    if not device.startswith("cuda"):
        return 1
    return max(1, min(CUDA_ROUTER_PROCESSES, cpus // 4))


def worker_tps(args: argparse.Namespace) -> tuple[int, int]:
    """(prefill, decode) workers' ranks: --prefill-tp / --decode-tp, else --tp (or --dp's)."""
    from pdserve.engine_flags import ranks

    every = ranks(args)
    if args.dp > 1 and {args.prefill_tp, args.decode_tp} - {0, args.dp}:
        raise ValueError(
            f"--dp {args.dp} runs every worker on {args.dp} ranks: --prefill-tp and "
            f"--decode-tp must be {args.dp} or unset"
        )
    return args.prefill_tp or every, args.decode_tp or every


def flight_dir(args: argparse.Namespace, log_dir: Path) -> str | None:
    """Where workers at TP > 1 dump their ranks' flight recorders: --flight-dir, else (some
    worker at TP > 1) LOG_DIR/flight (for `pdserve doctor --flight`). Passed to those workers
    only: a worker at TP 1 refuses it."""
    if max(worker_tps(args)) == 1:
        if args.flight_dir is not None:  # as serve would, before anything starts
            raise ValueError("a flight directory (--flight-dir) needs --tp 2 or more")
        return None
    return str(Path(args.flight_dir or log_dir / "flight").resolve())


def cmd_launch(args: argparse.Namespace) -> int:
    from pdserve.model.builtin import resolve_model
    from pdserve.runtime.launcher import LaunchConfig, Launcher
    from pdserve.server.auth import load_api_key

    if min(args.prefill_tp, args.decode_tp) < 0:
        raise ValueError("--prefill-tp and --decode-tp must be 0 (--tp's) or more")
    backend = launch_backend(args)
    gpus = launch_gpus(args)
    if backend is None or gpus is None:
        return 2
    if gpus and args.device == "auto":  # a placed worker must not fall back to the CPU
        args.device = "cuda"
    if args.mps and not (args.device.startswith("cuda") or args.device == "auto"):
        why = f"--mps needs the workers on CUDA, not {args.device}"
        print(f"pdserve launch: {why}", file=sys.stderr)
        return 2
    workers = args.prefill + args.decode
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-launch-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"pdserve launch: logs in {log_dir}", flush=True)
    flights = flight_dir(args, log_dir)
    args.flight_dir = None  # per worker (LaunchConfig.flight_dir), not one of the engine flags
    prefill_tp, decode_tp = worker_tps(args)
    key_file = args.cluster_key_file
    if key_file is None:
        from pdserve.runtime.cluster_key import generate

        key_file = str(log_dir / "cluster.key")
        Path(key_file).unlink(missing_ok=True)  # a log dir used again: a new cluster, a new key
        generate(key_file)
    api_key_file = None
    api_key = load_api_key(args.api_key, args.api_key_file)
    if api_key is not None:  # to the router in a 0600 file: never on a command line
        api_key_file = log_dir / "api.key"
        api_key_file.unlink(missing_ok=True)
        fd = os.open(api_key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(api_key + "\n")
    cfg = LaunchConfig(
        model_path=str(resolve_model(args.model)),
        served_model_name=args.served_model_name or args.model,
        prefill=args.prefill,
        decode=args.decode,
        threads=args.threads or max(1, (cpus or 1) // max(workers, 1)),
        prefill_threads=args.prefill_threads,
        decode_threads=args.decode_threads,
        engine_flags=engine_flags(args),
        log_dir=log_dir,
        cluster_key_file=str(Path(key_file).resolve()),
        api_key_file=str(api_key_file.resolve()) if api_key_file else None,
        protect_health=args.protect_health,
        reject_unknown_fields=args.reject_unknown_fields,
        tool_call_parser=args.tool_call_parser,
        trust_request_chat_template=args.trust_request_chat_template,
        prefix_index_pages=args.prefix_index_pages,
        prefix_max_imbalance=args.prefix_max_imbalance,
        max_queue=args.max_queue,
        host=args.host,
        port=args.port,
        router_processes=router_processes(args.device, cpus or 1)
        if args.router_processes is None
        else args.router_processes,
        backend=backend,
        debug_faults=args.debug_faults,
        policy=args.policy,
        worker_streams=args.worker_streams,
        log_level=args.log_level,
        request_timeout_s=args.request_timeout,
        startup_timeout_s=args.startup_timeout,
        on_worker_exit=args.on_worker_exit,
        gpus=gpus,
        gpu_memory_utilization=args.gpu_memory_utilization,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        flight_dir=flights,
        mps=args.mps,
    )
    return Launcher(cfg).run()
