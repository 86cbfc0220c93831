"""Percentiles, per-request TPOT, goodput and error counts on hand-made records."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.bench.config import Slo
from pdserve.bench.metrics import meets_slo, percentile, stats_ms, summarize, summarize_run
from pdserve.bench.record import ErrorKind, RequestRecord


def rec(
    ttft: float | None = 0.1,
    itl: tuple[float, ...] = (0.01, 0.01),
    tokens: int = 3,
    start: float = 0.0,
    error: ErrorKind | None = None,
    status: int | None = None,
    workload: str = "main",
) -> RequestRecord:
    r = RequestRecord(0, workload, start, prompt_len=10, target_output_len=tokens)
    r.ttft, r.itl, r.output_tokens = ttft, list(itl), tokens
    r.latency = (ttft or 0.0) + sum(itl)
    r.error, r.http_status = error, status
    return r


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
@pytest.mark.parametrize("q", [0.0, 1.0, 50.0, 90.0, 99.0, 99.9, 100.0])
def test_percentile_matches_numpy_linear(n: int, q: float) -> None:
    values = list(np.random.default_rng(n).exponential(size=n))
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_exact_small_cases() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([0.0, 10.0], 90) == 9.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_stats_in_milliseconds() -> None:
    s = stats_ms([0.001, 0.002, 0.003, 0.004])
    assert s is not None
    assert s["mean"] == pytest.approx(2.5)
    assert s["median"] == pytest.approx(2.5)
    assert s["max"] == pytest.approx(4.0)
    assert s["count"] == 4
    assert stats_ms([]) is None


def test_tpot_excludes_the_first_token() -> None:
    r = rec(ttft=0.5, itl=(0.1, 0.3), tokens=3)
    assert r.tpot == pytest.approx(0.2)
    assert rec(itl=(), tokens=1).tpot is None
    assert rec(error=ErrorKind.CONNECTION).tpot is None


def test_goodput_counts_requests_meeting_every_slo() -> None:
    fast = rec(ttft=0.1, itl=(0.01,), tokens=2)
    slow_first = rec(ttft=0.9, itl=(0.01,), tokens=2)
    slow_decode = rec(ttft=0.1, itl=(0.2,), tokens=2)
    one_token = rec(ttft=0.1, itl=(), tokens=1)  # no TPOT: meets any TPOT objective
    failed = rec(error=ErrorKind.STREAM_ERROR)
    slo = Slo(ttft_ms=500, tpot_ms=50)
    assert [meets_slo(r, slo) for r in (fast, slow_first, slow_decode, one_token, failed)] == [
        True,
        False,
        False,
        True,
        False,
    ]
    s = summarize([fast, slow_first, slow_decode, one_token, failed], 2.0, slo)
    assert s["goodput"]["good_requests"] == 2
    assert s["goodput"]["requests_per_s"] == pytest.approx(1.0)
    assert s["goodput"]["fraction"] == pytest.approx(0.4)
    assert "goodput" not in summarize([fast], 1.0, Slo())


def test_summary_counts_errors_by_kind_and_throughput_of_successes() -> None:
    records = [
        rec(tokens=3),
        rec(tokens=5, itl=(0.01,) * 4),
        rec(error=ErrorKind.HTTP, status=503),
        rec(error=ErrorKind.HTTP, status=503),
        rec(error=ErrorKind.CONNECTION),
        rec(error=ErrorKind.TIMEOUT),
    ]
    s = summarize(records, 4.0, Slo())
    assert (s["requests"], s["completed"], s["failed"]) == (6, 2, 4)
    assert s["errors"] == {"connection": 1, "http_503": 2, "timeout": 1}
    assert s["output_tokens"] == 8
    assert s["output_throughput"] == pytest.approx(2.0)
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["itl_ms"]["count"] == 6
    assert s["tpot_ms"]["count"] == 2
    assert s["tokens_per_chunk"] == pytest.approx(8 / 8)  # 3 chunks + 5 chunks, a token each


def test_tokens_per_chunk_counts_merged_chunks() -> None:
    merged = rec(ttft=0.1, itl=(0.02,), tokens=4)  # 4 tokens in 2 chunks
    plain = rec(ttft=0.1, itl=(0.01, 0.01), tokens=3)
    no_event = rec(ttft=None, itl=(), tokens=2)  # usage counted tokens no chunk showed
    failed = rec(error=ErrorKind.TIMEOUT, tokens=9)
    assert summarize([merged, plain, no_event, failed], 1.0, Slo())["tokens_per_chunk"] == (
        pytest.approx(7 / 5)
    )
    assert summarize([no_event], 1.0, Slo())["tokens_per_chunk"] is None


def test_per_workload_summaries_only_when_mixed() -> None:
    one = summarize_run([rec(), rec()], 1.0, Slo())
    assert "workloads" not in one
    mixed = summarize_run([rec(workload="a"), rec(workload="b"), rec(workload="b")], 1.0, Slo())
    assert mixed["workloads"]["b"]["completed"] == 2
    assert mixed["workloads"]["a"]["completed"] == 1


def test_slo_parse() -> None:
    assert Slo.parse(["ttft:500", "tpot:50"]) == Slo(ttft_ms=500.0, tpot_ms=50.0)
    assert Slo.parse([]).empty
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            Slo.parse(bad)
