"""RouterConfig: everything the router process needs, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.config import FrontendConfig, HttpLimits
from pdserve.router.policy import POLICIES
from pdserve.router.prefix_index import DEFAULT_CAPACITY_PAGES

WORKER_STREAMS = ("shared", "per-request")


@dataclass(frozen=True)
class RouterConfig:
    decode_urls: tuple[str, ...]  # co-located workers when there are no prefill workers
    prefill_urls: tuple[str, ...]
    model_path: str  # a resolved local directory: the router only needs its tokenizer
    served_model_name: str | None = None  # None: the workers' model name
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "least-outstanding"
    prefix_index_pages: int = DEFAULT_CAPACITY_PAGES  # --policy prefix: page keys per worker
    prefix_max_imbalance: int = 8  # --policy prefix: extra in-flight requests a hit may cost
    request_timeout_s: float = 600.0  # default per-request bound when the client gives none
    startup_timeout_s: float = 60.0  # how long to wait for every worker's /info at startup
    connect_timeout_s: float = 3.0  # TCP connect to a worker
    health_interval_s: float = 1.0  # liveness poll period
    health_timeout_s: float = 2.0  # one /health call
    deep_timeout_s: float = 10.0  # one canary request through a (P, D) pair
    pair_retry_s: float = 5.0  # how often a failed pair is re-probed in the background
    abort_timeout_s: float = 2.0  # the fire-and-forget POST /abort to a worker
    debug_timeout_s: float = 3.0  # fetching one worker's /debug/state
    drain_timeout_s: float = 10.0  # graceful stop: how long running requests may finish
    http: HttpLimits = field(default_factory=HttpLimits)  # connection limits (server/listener.py)
    cluster_key_file: str | None = None  # None: $PDSERVE_CLUSTER_KEY_FILE, or no key
    api_key: str | None = field(default=None, repr=False)  # clients' key for /v1 (server/auth.py)
    protect_health: bool = False  # /health and /metrics need a key too
    max_queue: int = 4096  # completion calls in flight at most (server/admission.py)
    # "shared": one output stream per worker carries every request's outputs (router/channel.py);
    # "per-request": each /generate streams its own (the A/B of benchmarks/serving/gpu_serving.py).
    worker_streams: str = "shared"
    # Bind with SO_REUSEPORT: one of several routers on one port (router/pool.py).
    reuse_port: bool = False
    frontend: FrontendConfig = field(default_factory=FrontendConfig)  # the OpenAI API's choices

    def __post_init__(self) -> None:
        if not self.decode_urls:
            raise ValueError("the router needs at least one --decode worker URL")
        for url in self.decode_urls + self.prefill_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL {url!r} must start with http:// or https://")
        dupes = {
            u
            for u in self.decode_urls + self.prefill_urls
            if (self.decode_urls + self.prefill_urls).count(u) > 1
        }
        if dupes:
            raise ValueError(f"worker URLs given more than once: {sorted(dupes)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.prefix_index_pages < 1 or self.prefix_max_imbalance < 0:
            raise ValueError(
                "--prefix-index-pages must be >= 1 and --prefix-max-imbalance >= 0, got "
                f"{self.prefix_index_pages} and {self.prefix_max_imbalance}"
            )
        if self.worker_streams not in WORKER_STREAMS:
            raise ValueError(
                f"--worker-streams must be one of {WORKER_STREAMS}, got {self.worker_streams!r}"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        timeouts = (
            self.request_timeout_s,
            self.startup_timeout_s,
            self.connect_timeout_s,
            self.health_interval_s,
            self.health_timeout_s,
            self.deep_timeout_s,
            self.pair_retry_s,
            self.abort_timeout_s,
            self.debug_timeout_s,
        )
        finite = all(math.isfinite(t) for t in (*timeouts, self.drain_timeout_s))
        if not finite or min(timeouts) <= 0 or self.drain_timeout_s < 0:
            raise ValueError(f"router timeouts must be positive and finite: {self}")
