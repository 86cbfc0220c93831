"""Timing a small function in-process, for the micro-benchmarks (stream_encode.py,
generate_body.py): the median of `repeats` timeit runs of `number` calls, in µs per call."""

from __future__ import annotations

import statistics
import timeit
from collections.abc import Callable


def us(fn: Callable[[], object], number: int, repeats: int) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeats)) / number * 1e6
