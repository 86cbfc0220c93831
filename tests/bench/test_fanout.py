"""`pdserve bench --processes N` (bench/fanout.py): the split, the merge, and a real run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.config import ArrivalConfig, Slo
from pdserve.bench.dataset import BenchRequest
from pdserve.bench.fanout import merge, split
from pdserve.bench.stub import StubServer

REQS = [BenchRequest((1, 2, i), 3, 4) for i in range(10)]


def test_requests_concurrency_and_rate_are_dealt_evenly():
    shards = split(REQS, ArrivalConfig(request_rate=8.0, max_concurrency=5), 3)
    assert [s.positions for s in shards] == [(0, 3, 6, 9), (1, 4, 7), (2, 5, 8)]
    assert [s.requests[1].prompt for s in shards] == [(1, 2, 3), (1, 2, 4), (1, 2, 5)]
    assert [s.arrival.max_concurrency for s in shards] == [2, 2, 1]
    assert all(s.arrival.request_rate == pytest.approx(8.0 / 3) for s in shards)
    free = split(REQS, ArrivalConfig(), 2)
    assert all(s.arrival.max_concurrency is None and math.isinf(s.arrival.request_rate)
               for s in free)  # fmt: skip


@pytest.mark.parametrize(
    "n, arrival, why",
    [
        (0, ArrivalConfig(), "--processes must be in"),
        (11, ArrivalConfig(), "at most one per request"),
        (4, ArrivalConfig(max_concurrency=3), "cannot be shared by 4"),
    ],
)
def test_a_split_that_cannot_be_is_refused(n, arrival, why):
    with pytest.raises(ValueError, match=why):
        split(REQS, arrival, n)


def test_the_merge_puts_every_record_on_the_first_clock():
    shards = split(REQS[:4], ArrivalConfig(), 2)

    def rec(index: int, start: float) -> dict:
        return {"index": index, "workload": "main", "start": start, "prompt_len": 3,
                "target_output_len": 4, "ttft": 0.1, "itl": [0.01, 0.02, 0.03], "latency": 0.16,
                "output_tokens": 4, "prompt_tokens": 3, "finish_reason": "length",
                "error": None, "error_detail": None, "http_status": None}  # fmt: skip

    payloads = [
        {"records": [rec(0, 0.0), rec(1, 0.5)], "duration_s": 1.0, "started_at": 100.0,
         "model": "m", "warmup_errors": []},
        {"records": [rec(0, 0.2), rec(1, 0.3)], "duration_s": 1.5, "started_at": 100.25,
         "model": "m", "warmup_errors": ["x"]},
    ]  # fmt: skip
    run = merge(shards, payloads, Slo())
    assert [(r.index, r.start) for r in run.records] == [
        (0, 0.0), (1, 0.45), (2, 0.5), (3, 0.55),
    ]  # fmt: skip
    assert run.duration_s == pytest.approx(1.75) and run.warmup_errors == ["x"]
    assert run.summary["completed"] == 4 and run.summary["output_tokens"] == 16


@pytest.mark.process
def test_a_run_from_three_processes_reports_as_one(tmp_path: Path):
    out = tmp_path / "run.json"
    with StubServer(tokens=5) as stub:
        done = subprocess.run(
            [sys.executable, "-m", "pdserve", "bench", "--url", stub.url, "--no-progress",
             "--num-prompts", "30", "--input-len", "8", "--output-len", "5", "--warmup", "1",
             "--max-concurrency", "6", "--processes", "3", "--out", str(out)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["summary"]["completed"] == 30 and doc["summary"]["failed"] == 0
    assert sorted(r["index"] for r in doc["records"]) == list(range(30))
    assert all(r["output_tokens"] == 5 and len(r["itl"]) == 4 for r in doc["records"])
    starts = [r["start"] for r in doc["records"]]
    assert starts == sorted(starts) and 0 <= starts[0] < doc["summary"]["duration_s"]
    assert "requests (completed / sent)" in done.stdout
