"""When each request starts: offsets from the start of the run, drawn up front.

Inter-arrival gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)): the mean gap is
1/rate whatever the burstiness, shape 1 is a Poisson process, a smaller shape clusters
arrivals into bursts and a larger one spaces them more evenly. Drawing the whole schedule
before the run keeps the random stream independent of how fast the server answers, so one
seed gives one schedule. An infinite rate sends everything at offset 0.
"""

from __future__ import annotations

import math

import numpy as np

from pdserve.bench.config import ArrivalConfig


def inter_arrival_gaps(
    n: int, rate: float, burstiness: float, rng: np.random.Generator
) -> np.ndarray:
    """`n` gaps in seconds; all zero for an infinite rate."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if math.isinf(rate):
        return np.zeros(n)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def schedule(n: int, cfg: ArrivalConfig, seed: int) -> list[float]:
    """Start offsets (seconds from the run's start) of `n` requests; the first starts at 0."""
    gaps = inter_arrival_gaps(n, cfg.request_rate, cfg.burstiness, np.random.default_rng(seed))
    if n == 0:
        return []
    # The first request goes out at once; the gaps separate it from the ones after it.
    offsets = np.concatenate(([0.0], np.cumsum(gaps[:-1])))
    return [float(t) for t in offsets]
