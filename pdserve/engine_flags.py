"""The engine's command-line flags (`serve`, and `launch`, which passes them on), and the
EngineConfig they make."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TypeVar

from pdserve.config import (
    ATTENTION_BACKENDS,
    INDEX_K_DTYPES,
    KV_DTYPES,
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    ModelSpec,
    RunnerConfig,
    SchedulerConfig,
    resolve_device,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument(
        "--model",
        default="builtin:tiny",
        help="builtin:NAME, a local Hugging Face model directory, or a .gguf file (or a "
        "directory holding one)",
    )
    g.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto = the checkpoint's torch_dtype",
    )
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument(
        "--kv-budget-mb",
        type=float,
        default=None,
        help="memory for the KV pool (default: on CUDA, --gpu-memory-utilization of the card "
        "less the weights and an activation reserve; on a CPU, 256)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=CacheConfig.gpu_memory_utilization,
        help="the share of a CUDA card this worker may hold when --kv-budget-mb is not given "
        "(launch divides it among the workers that share a card)",
    )
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    # Two store_true flags; --no-prefix-cache wins over --prefix-cache (engine_config).
    g.add_argument(
        "--prefix-cache",
        action="store_true",
        help="reuse the KV pages of cached prompt prefixes"
        + (" (the default)" if CacheConfig.prefix_cache else ""),
    )
    g.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="no prefix cache: every request computes its whole prompt's KV",
    )
    g.add_argument(
        "--host-cache-mb",
        type=float,
        default=0.0,
        help="host memory (pinned on CUDA) for KV pages evicted from the prefix cache, "
        "loaded back on a later hit (0: none)",
    )
    g.add_argument(
        "--index-k-dtype",
        default="auto",
        choices=INDEX_K_DTYPES,
        help="DeepSeek-V3.2's indexer keys in the KV cache: auto = the model dtype (exact "
        "against HF), fp8 = float8_e4m3fn with a float32 scale per token; P and D must agree",
    )
    g.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="a block-quantised fp8 checkpoint (DeepSeek-V3/V3.2): auto = its weights stay fp8 "
        "and multiply through block-scaled fp8 kernels (activations quantised per 128 "
        "values), fp8 = the same, refused for a checkpoint with nothing to keep, none = "
        "dequantised to --dtype on load",
    )
    g.add_argument(
        "--kv-dtype",
        default="auto",
        choices=KV_DTYPES,
        help="DeepSeek-V4's compressed KV and indexer keys: auto = the model dtype (exact "
        "against HF), fp8 = float8_e4m3fn with float32 scales (a scale per 64 channels, the "
        "rotary part in the model dtype); other models: auto only; P and D must agree",
    )
    g.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="token budget per step (default: 4096 on CUDA, 512 on a CPU)",
    )
    g.add_argument(
        "--max-running",
        type=int,
        default=None,
        help="cap on running requests (default: 256 on CUDA, 64 on a CPU)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="cap on prompt + output (default: the model's context; always capped by what "
        "the KV pool holds)",
    )
    g.add_argument(
        "--attention-backend",
        default=None,
        choices=ATTENTION_BACKENDS,
        help="attention kernels (default: the device's: torch on CPU)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: every step runs eagerly",
    )
    g.add_argument(
        "--overlap-schedule",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prepare each step on the CPU while the device runs the one before (default: on "
        "for CUDA, off on a CPU)",
    )
    g.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the engine, its role and their threads in a process of their own, apart "
        "from the HTTP server's event loop, so the two share no GIL (default: on for CUDA, "
        "off on a CPU)",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks: the worker's engine is rank 0 and starts the others as "
        "processes of its own (rank r on cuda:r, or all on the CPU over gloo); the Llama "
        "family, co-located, without overlapped scheduling or CUDA graphs",
    )
    g.add_argument(
        "--dp",
        type=int,
        default=1,
        help="data-parallel attention over this many ranks (with --ep; DeepSeek-V3/V3.2; a "
        "PD worker on the CPU over shm or tcp): each rank attends its own requests and holds "
        "1/N of the experts, the MoE layers exchanging tokens; --tp, if given, must be the same",
    )
    g.add_argument(
        "--ep",
        action="store_true",
        help="expert parallel, with --dp: the routed experts are split over the ranks (at "
        "--tp N a DeepSeek model's experts are split already)",
    )
    g.add_argument(
        "--flight-dir",
        default=None,
        metavar="DIR",
        help="with --tp 2 or more (refused without): if the ranks fall out of lockstep each "
        "writes its last step records to DIR/tp-<pid>-<start>/rank-<r>.json, for `pdserve "
        "doctor --flight DIR` (default: to the log only; launch: LOG_DIR/flight)",
    )
    g.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=256,
        help="the largest decode batch replayed as a CUDA graph (capped by --max-running)",
    )
    g.add_argument(
        "--cuda-graph-max-tokens",
        type=int,
        default=RunnerConfig.cuda_graph_max_tokens,
        help="the most tokens (decodes included) of a step that carries prefill chunks replayed "
        "as a CUDA graph (capped by --max-batched-tokens; 0: such steps run eagerly)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may live before it is failed",
    )


def host_cache_bytes(args: argparse.Namespace) -> int:
    """--host-cache-mb, but none on a decode worker: it never looks its cache up (its prompts
    are computed by prefill workers), and a page it evicted may be written by a peer's RDMA
    into the reused page before an asynchronous copy to the host has read it."""
    if getattr(args, "role", "colocated") == "decode":
        if args.host_cache_mb:
            log.warning("--host-cache-mb is ignored on a decode worker")
        return 0
    return int(args.host_cache_mb * 2**20)


def use_engine_process(flag: bool | None, device: str) -> bool:
    """`--engine-process` as given, else on for CUDA: there a served engine thread is
    host-bound, and in one process the worker's event loop takes the GIL inside its tick
    (docs/architecture.md §Threads "Engine process"; benchmarks/RESULTS.md)."""
    return device.startswith("cuda") if flag is None else flag


def engine_process_argv(flag: bool | None) -> list[str]:
    """`serve`'s argv for `flag`: nothing for None (serve's default)."""
    return [] if flag is None else ["--engine-process" if flag else "--no-engine-process"]


def given(value: T | None, placeholder: T) -> T:
    """A flag's value, or the placeholder a limit left to engine/sizing.py holds until then."""
    return placeholder if value is None else value


def ranks(args: argparse.Namespace) -> int:
    """The worker's ranks: --tp, or --dp's with data-parallel attention (whose --ep it needs;
    a --tp beside it must agree: tensor-parallel attention within each data-parallel rank is
    not built)."""
    if args.dp < 1:
        raise ValueError(f"--dp must be 1 or more, got {args.dp}")
    if args.dp == 1:
        if args.ep:
            raise ValueError(
                "--ep goes with --dp N (at --tp N a DeepSeek model's experts are split already)"
            )
        return int(args.tp)
    if not args.ep:
        raise ValueError(
            f"--dp {args.dp} shards the experts over the ranks: add --ep (data-parallel "
            "attention with every expert on every rank is not built)"
        )
    if args.tp not in (1, args.dp):
        raise ValueError(
            f"--dp {args.dp} with --tp {args.tp}: each data-parallel rank attends whole "
            f"(tensor-parallel attention within it is not built); give --tp {args.dp} or none"
        )
    return int(args.dp)


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
            quantization=args.quantization,
        ),
        cache=CacheConfig(
            page_size=args.page_size,
            kv_budget_bytes=int(given(args.kv_budget_mb, 256.0) * 2**20),
            gpu_memory_utilization=args.gpu_memory_utilization,
            prefix_cache=(CacheConfig.prefix_cache or args.prefix_cache)
            and not args.no_prefix_cache,
            host_cache_bytes=host_cache_bytes(args),
            index_k_dtype=args.index_k_dtype,
            kv_dtype=args.kv_dtype,
        ),
        # A limit not given keeps the placeholder until Engine.build resolves it (`auto`).
        scheduler=SchedulerConfig(
            max_batched_tokens=given(args.max_batched_tokens, SchedulerConfig.max_batched_tokens),
            max_running=given(args.max_running, SchedulerConfig.max_running),
            max_model_len=given(args.max_model_len, SchedulerConfig.max_model_len),
        ),
        runner=RunnerConfig(
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            overlap_schedule=args.overlap_schedule,
            cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        ),
        request_timeout_s=args.request_timeout,
        tp=ranks(args),
        dp_attention=args.dp > 1,
        flight_dir=str(Path(args.flight_dir).resolve()) if args.flight_dir else None,
        auto=frozenset(
            name
            for name, value in (
                ("kv_budget", args.kv_budget_mb),
                ("max_model_len", args.max_model_len),
                ("max_running", args.max_running),
                ("max_batched_tokens", args.max_batched_tokens),
            )
            if value is None
        ),
    )
