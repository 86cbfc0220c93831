"""The arrival process: seeded gamma gaps with mean 1/rate; burstiness shapes the spread."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.arrival import inter_arrival_gaps, schedule
from pdserve.bench.config import ArrivalConfig


@pytest.mark.parametrize("rate", [0.5, 4.0, 200.0])
@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_mean_gap_is_one_over_rate(rate: float, burstiness: float) -> None:
    gaps = inter_arrival_gaps(200_000, rate, burstiness, np.random.default_rng(7))
    # The mean of 2e5 gamma samples is within 1% of 1/rate with overwhelming probability
    # (its relative standard error is 1/sqrt(2e5 * shape) <= 0.5%).
    assert gaps.mean() == pytest.approx(1.0 / rate, rel=0.02)
    # Gamma(shape k): the squared coefficient of variation is 1/k (1 for Poisson).
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1.0 / burstiness, rel=0.05)


def test_poisson_gaps_are_memoryless() -> None:
    gaps = inter_arrival_gaps(100_000, 10.0, 1.0, np.random.default_rng(3))
    # Exponential: P(gap > 2/rate) = e^-2.
    assert (gaps > 0.2).mean() == pytest.approx(math.exp(-2), abs=0.01)


def test_schedule_is_seeded_sorted_and_starts_at_zero() -> None:
    cfg = ArrivalConfig(request_rate=5.0)
    a, b = schedule(50, cfg, seed=1), schedule(50, cfg, seed=1)
    assert a == b
    assert a != schedule(50, cfg, seed=2)
    assert a[0] == 0.0
    assert all(x <= y for x, y in zip(a, a[1:], strict=False))
    assert schedule(0, cfg, seed=1) == []


def test_infinite_rate_sends_everything_at_once() -> None:
    assert schedule(5, ArrivalConfig(), seed=0) == [0.0] * 5


def test_arrival_config_rejects_nonsense() -> None:
    for kwargs in ({"request_rate": 0.0}, {"burstiness": 0.0}, {"max_concurrency": 0}):
        with pytest.raises(ValueError):
            ArrivalConfig(**kwargs)  # type: ignore[arg-type]
