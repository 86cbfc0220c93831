"""SamplingParams: how one request's tokens are chosen and when it stops (token level).

Validation lives here so every entry point (HTTP API, router, tests) refuses the same bad
input with the same message. Stop *strings* are text and are handled where text exists
(the API layer); the engine only knows token ids.
"""

from __future__ import annotations

from dataclasses import dataclass


class InvalidParams(ValueError):
    """Bad request parameters: the caller's fault, reported as HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives to return per token

    def __post_init__(self) -> None:
        def bad(param: str, why: str) -> InvalidParams:
            return InvalidParams(f"{param} {why}, got {getattr(self, param)!r}", param)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", "must be >= 0 (0 disables it)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise bad("min_tokens", "must be in [0, max_tokens]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "must be in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def needs_filtering(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
