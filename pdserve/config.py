"""Configuration: frozen dataclasses, one per concern, composed per role.

"auto" values (device, dtype, context length) are resolved before construction by
`resolve_*` helpers, so a constructed config is always concrete and valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.protocol.messages import BACKENDS as BACKENDS

QUANTIZATIONS = ("auto", "fp8", "none")  # --quantization


@dataclass(frozen=True)
class ModelSpec:
    path: str  # a local HF directory, after builtin:NAME was resolved
    name: str  # the name clients use in "model"
    dtype: str = "float32"
    device: str = "cpu"
    # A block-quantised fp8 checkpoint's weights (model/fp8_weights.py): "auto" keeps them fp8
    # where a kernel multiplies them as stored, "fp8" insists, "none" dequantises on load.
    quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )


INDEX_K_DTYPES = ("auto", "fp8")  # --index-k-dtype
KV_DTYPES = ("auto", "fp8")  # --kv-dtype (kvcache/v4_layout.py KV_DTYPES, which needs torch)


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    kv_budget_bytes: int = 256 * 2**20
    # Reuse the KV of cached prompt prefixes (kvcache/prefix_cache.py); --no-prefix-cache.
    prefix_cache: bool = True
    # Host memory for pages evicted from the prefix cache (kvcache/host_pool.py); 0: none.
    host_cache_bytes: int = 0
    # DeepSeek-V3.2's index-K (kvcache/layout.py index_k_buffers): "auto" = the model dtype,
    # "fp8" = float8_e4m3fn plus a float32 scale per token. Other models ignore it.
    index_k_dtype: str = "auto"
    # DeepSeek-V4's compressed KV (kvcache/v4_layout.py): "auto" = the model dtype, "fp8" =
    # float8_e4m3fn with float32 block scales, the rotary part in the model dtype. Other
    # models refuse "fp8" (KVLayout.for_model).
    kv_dtype: str = "auto"
    # The share of a CUDA card's memory this worker may hold (weights, activations, KV), when
    # the KV budget is left to engine/sizing.py; vLLM's name and default.
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.kv_budget_bytes < 1:
            raise ValueError(f"kv budget must be positive, got {self.kv_budget_bytes}")
        if self.index_k_dtype not in INDEX_K_DTYPES:
            raise ValueError(
                f"index-K dtype must be one of {INDEX_K_DTYPES}, got {self.index_k_dtype!r}"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu memory utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.host_cache_bytes < 0:
            raise ValueError(f"host cache size must be >= 0, got {self.host_cache_bytes}")
        if self.host_cache_bytes and not self.prefix_cache:
            raise ValueError("a host cache (--host-cache-mb) needs the prefix cache")


@dataclass(frozen=True)
class SchedulerConfig:
    max_batched_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    max_running: int = 64
    max_model_len: int = 2048  # prompt + output, capped by the model's context

    def __post_init__(self) -> None:
        if self.max_batched_tokens < 1 or self.max_running < 1 or self.max_model_len < 2:
            raise ValueError(f"scheduler limits must be positive: {self}")


# Attention backends by name (attention/registry.py builds them; named here so the CLI and the
# router-side configs need no torch).
ATTENTION_BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class RunnerConfig:
    attention_backend: str | None = None  # an attention backend's name; None: the device's
    enforce_eager: bool = False  # no CUDA graphs
    cuda_graph_max_bs: int = 256  # the largest decode batch replayed as a graph (CUDA only)
    # Overlapped scheduling (engine/inflight.py): the CPU prepares step N+1 while the device
    # runs step N. None: on for CUDA, off elsewhere (a CPU runs the "device" work itself).
    overlap_schedule: bool | None = None
    # The most tokens (decodes included) of a step that carries prefill chunks replayed as a
    # CUDA graph (CUDA only; 0: such steps run eagerly; capped by the step budget,
    # max_batched_tokens).
    cuda_graph_max_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"unknown attention backend {self.attention_backend!r}")
        if not 1 <= self.cuda_graph_max_bs <= 1024:
            raise ValueError(
                f"cuda_graph_max_bs must be in [1, 1024], got {self.cuda_graph_max_bs}"
            )
        if not 0 <= self.cuda_graph_max_tokens <= 65536:
            raise ValueError(
                f"cuda_graph_max_tokens must be in [0, 65536], got {self.cuda_graph_max_tokens}"
            )


MAX_TP = 64  # --tp's bound: ranks on one host

# The limits `serve` leaves to engine/sizing.py unless given (EngineConfig.auto).
AUTO_LIMITS = frozenset({"kv_budget", "max_model_len", "max_running", "max_batched_tokens"})


@dataclass(frozen=True)
class EngineConfig:
    model: ModelSpec
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    request_timeout_s: float = 600.0  # no request lives longer than this in the engine
    idle_wait_s: float = 0.05  # how long the idle engine loop blocks on its inbox
    # Limits (of AUTO_LIMITS) the user left unset: Engine.build chooses them from the model
    # and the device (engine/sizing.py) and replaces the placeholders above.
    auto: frozenset[str] = frozenset()
    # Tensor-parallel ranks (--tp): the engine is rank 0 and starts ranks 1..tp-1 as processes
    # of their own (engine/tp_leader.py); the Llama family only.
    tp: int = 1
    # Data-parallel attention (--dp N --ep, DeepSeek-V3/V3.2): each of the tp ranks attends its
    # own requests and holds 1/tp of the experts (engine/dp_step.py); else every rank attends
    # every request.
    dp_attention: bool = False
    # Where the ranks write their flight recorders if the group fails (--flight-dir;
    # parallel/flight_recorder.py); None: to the log only.
    flight_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.auto <= AUTO_LIMITS:
            raise ValueError(f"unknown auto limits {sorted(self.auto - AUTO_LIMITS)}")
        if not 1 <= self.tp <= MAX_TP:
            raise ValueError(
                f"tensor-parallel ranks (--tp) must be in [1, {MAX_TP}], got {self.tp}"
            )
        if self.tp > 1 and self.cache.host_cache_bytes:
            # Its loads copy pages back into rank 0's pool only.
            raise ValueError("a host cache (--host-cache-mb) needs --tp 1")
        if self.tp == 1 and self.flight_dir is not None:
            # Only the ranks of a tensor-parallel group keep a flight recorder to dump.
            raise ValueError("a flight directory (--flight-dir) needs --tp 2 or more")
        if self.dp_attention and self.tp == 1:
            raise ValueError("data-parallel attention (--dp) needs 2 or more ranks")
        if self.tp > 1 and self.runner.overlap_schedule:
            # A step's record carries every input id, so none may be still on the device.
            raise ValueError("overlapped scheduling (--overlap-schedule) needs --tp 1")


@dataclass(frozen=True)
class HttpLimits:
    """An HTTP server's connection limits (server/listener.py enforces them)."""

    max_connections: int | None = None  # None: connection_cap(fds_per_connection)
    idle_timeout_s: float = 5.0  # keep-alive: no request byte this long after connect/response
    header_timeout_s: float = 10.0  # a request head must be complete this long after its start
    write_stall_s: float = 30.0  # a client reading none of its response this long is cut off

    def __post_init__(self) -> None:
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        for name in ("idle_timeout_s", "header_timeout_s", "write_stall_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class FrontendConfig:
    """The OpenAI front end's choices (a co-located server's, the router's)."""

    # A tool-call parser's name (frontend/tool_calls/chooser.py), or "auto": the one the chat
    # template's markers tell (frontend/tool_use.py).
    tool_call_parser: str = "auto"
    # Render a request's own chat_template (frontend/template_jail.py); off: such a request
    # is a 400 naming the field and the flag (vLLM's --trust-request-chat-template).
    trust_request_chat_template: bool = False

    def __post_init__(self) -> None:
        if not self.tool_call_parser:
            raise ValueError("tool_call_parser must be a parser's name or auto")


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    role: str = "colocated"  # colocated | prefill | decode
    control_port: int = 0  # prefill: ZMQ control socket (0 = pick a free port)
    backend: str = "shm"  # shm | tcp | nixl: the KV data plane between prefill and decode
    debug_faults: bool = False  # POST /debug/faults may set fault points at run time
    # The cluster's shared secret (runtime/cluster_key.py); None: $PDSERVE_CLUSTER_KEY_FILE.
    # Prefill and decode workers need one; a co-located server without one leaves its
    # worker API and /debug/* open (it then should listen on loopback only).
    cluster_key_file: str | None = None
    api_key: str | None = field(default=None, repr=False)  # clients' key for /v1 (server/auth.py)
    protect_health: bool = False  # /health and /metrics need a key too
    max_queue: int = 4096  # completion calls in flight at most (server/admission.py)
    http: HttpLimits = field(default_factory=HttpLimits)
    drain_timeout_s: float = 10.0  # graceful stop: how long running requests may finish
    frontend: FrontendConfig = field(default_factory=FrontendConfig)  # a co-located server's API
    # The engine, its role and their threads in a process of their own (worker/host/process.py).
    # `serve` resolves it: on for CUDA unless told otherwise (engine_flags.use_engine_process).
    engine_process: bool = False

    def __post_init__(self) -> None:
        if self.role not in ("colocated", "prefill", "decode"):
            raise ValueError(f"role must be colocated, prefill or decode, got {self.role!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be shm, tcp or nixl, got {self.backend!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        if self.engine.tp > 1 and self.role != "colocated":
            # The leader reads and writes its ranks' pools as shared host memory
            # (kvcache/rank_pages.py); NIXL moves one registered pool.
            if self.engine.model.device != "cpu":
                raise ValueError(
                    f"a {self.role} worker at --tp {self.engine.tp} runs on the CPU: its leader "
                    "moves every rank's pages through shared host memory"
                )
            if self.backend == "nixl":
                raise ValueError(
                    f"a {self.role} worker at --tp {self.engine.tp} moves KV over shm or tcp: "
                    "--backend nixl writes one pool into one pool"
                )


def resolve_device(name: str) -> str:
    import torch  # here, not at module level: `pdserve doctor` and `bench` never need torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    return name
