"""What a benchmark run does: frozen configs for the client, the dataset, arrivals and SLOs.

Every value is checked in `__post_init__`, so a constructed config can be trusted by the
runner; the command line only translates flags into these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import aiohttp

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
DATASETS = ("random", "sharegpt", "shared-prefix")
PROMPT_FORMATS = ("ids", "text")


@dataclass(frozen=True)
class ClientConfig:
    """How to talk to the server under test."""

    url: str  # base URL, e.g. http://127.0.0.1:8000
    endpoint: str = "completions"  # a key of ENDPOINTS
    model: str | None = None  # None: ask /v1/models, or send none if that fails
    ignore_eos: bool = True  # generate exactly the requested output length (vLLM extension)
    request_timeout_s: float = 600.0  # a whole request, first byte to [DONE]
    connect_timeout_s: float = 10.0
    api_key: str | None = field(default=None, repr=False)  # sent as Authorization: Bearer

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.url!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if self.request_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeouts must be positive")

    @cached_property
    def timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.request_timeout_s, connect=self.connect_timeout_s)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def api_url(self) -> str:
        return self.url.rstrip("/") + ENDPOINTS[self.endpoint]


@dataclass(frozen=True)
class DatasetConfig:
    """Which requests to send; the fields of the other datasets are ignored."""

    name: str = "random"  # one of DATASETS
    num_prompts: int = 100
    seed: int = 0
    prompt_format: str = "ids"  # ids: token-id lists (/v1/completions only); text: strings
    tokenizer: str | None = None  # builtin:NAME or a model dir: exact lengths and valid ids
    # random
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0  # lengths are uniform in [len * (1 - r), len * (1 + r)]
    # sharegpt
    path: str | None = None
    sharegpt_output_len: int | None = None  # None: the length of the recorded answer
    # shared-prefix
    sp_prompts_per_group: int = 8
    sp_system_len: int = 1024
    sp_question_len: int = 64

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.name!r}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt format must be one of {PROMPT_FORMATS}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if min(self.input_len, self.output_len, self.sp_system_len, self.sp_question_len) < 1:
            raise ValueError("lengths must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.sp_prompts_per_group < 1:
            raise ValueError("--sp-prompts-per-group must be >= 1")
        if self.name == "sharegpt" and not self.path:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE")


@dataclass(frozen=True)
class ArrivalConfig:
    """When requests start: a gamma process (Poisson at burstiness 1), capped in flight."""

    request_rate: float = math.inf  # requests/s; inf sends everything at once
    burstiness: float = 1.0  # gamma shape: < 1 burstier than Poisson, > 1 more regular
    max_concurrency: int | None = None  # None: no cap on requests in flight

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


@dataclass(frozen=True)
class Slo:
    """Per-request service-level objectives; a request meets them if it meets every one set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms):
            if v is not None and not v > 0:
                raise ValueError(f"SLO values must be positive milliseconds, got {v}")

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None

    @classmethod
    def parse(cls, items: Sequence[str]) -> Slo:
        """['ttft:500', 'tpot:50'] -> Slo(ttft_ms=500, tpot_ms=50)."""
        values: dict[str, float] = {}
        for item in items:
            key, sep, ms = item.partition(":")
            if not sep or key not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"--slo takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
            try:
                values[f"{key}_ms"] = float(ms)
            except ValueError:
                raise ValueError(f"--slo {item!r}: {ms!r} is not a number") from None
        return cls(**values)

    def as_dict(self) -> dict[str, float]:
        return {
            k: v
            for k, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms))
            if v is not None
        }


@dataclass(frozen=True)
class BenchConfig:
    client: ClientConfig
    dataset: DatasetConfig
    arrival: ArrivalConfig
    slo: Slo = Slo()
    warmup: int = 1  # requests sent (and awaited) before the clock starts
    progress: bool = True  # a plain-text progress line on stderr
    max_failure_rate: float = 0.0  # more failed than this fraction: the run failed (exit 1)

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if not 0.0 <= self.max_failure_rate <= 1.0:
            raise ValueError(
                f"--max-failure-rate must be a fraction in [0, 1], got {self.max_failure_rate}"
            )
        if self.client.endpoint == "chat" and self.dataset.prompt_format == "ids":
            raise ValueError("--endpoint chat needs --prompt-format text (chat has no token ids)")
