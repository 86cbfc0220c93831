"""SamplingParams and its validation, for engine code: they live in pdserve/protocol/sampling.py
(torch-free, so the router shares them); this module re-exports them."""

from __future__ import annotations

from pdserve.protocol.sampling import (
    GREEDY_TEMPERATURE,
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    SEED_MAX,
    SEED_MIN,
    InvalidParams,
    SamplingParams,
    is_int,
    is_number,
    show,
    validate_prompt,
)

__all__ = [
    "GREEDY_TEMPERATURE",
    "INT32_MAX",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_LOGPROBS",
    "MAX_REPETITION_PENALTY",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TEMPERATURE",
    "MIN_REPETITION_PENALTY",
    "SEED_MAX",
    "SEED_MIN",
    "InvalidParams",
    "SamplingParams",
    "is_int",
    "is_number",
    "show",
    "validate_prompt",
]
