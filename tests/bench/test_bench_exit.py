"""`pdserve bench`'s exit status: 1 when more than --max-failure-rate of its requests failed.

Run as a user runs it (a subprocess), against a port where nothing listens (every request
fails) and against the stub answering 503 to every second call (exactly half fail).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.bench.metrics import too_many_failures
from pdserve.bench.stub import StubServer

TIMEOUT_S = 60


@pytest.fixture
def dead_url() -> Iterator[str]:
    """A loopback port that is bound but not listening: every connect is refused, and no
    other process can take the port while the test runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def bench(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pdserve", "bench", "--url", url, "--no-progress"]
    argv += ["--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--warmup", "0"]
    return subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.mark.process
def test_every_request_failed_exits_1_and_says_why(dead_url: str, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    done = bench(dead_url, "--out", str(out))
    assert done.returncode == 1, done.stderr
    assert "requests (completed / sent)" in done.stdout  # the report is still printed
    assert json.loads(out.read_text())["summary"]["failed"] == 4  # and written
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("pdserve bench: exit 1: 4 of 4 requests failed (100.0%: connection 4)")
    assert "--max-failure-rate 0 allows" in last
    assert "Traceback" not in done.stderr


@pytest.mark.process
def test_a_threshold_of_one_accepts_any_failure(dead_url: str) -> None:
    done = bench(dead_url, "--max-failure-rate", "1")
    assert done.returncode == 0, done.stderr
    assert "exit 1" not in done.stderr


@pytest.mark.process
def test_half_failed_against_the_threshold_either_side() -> None:
    with StubServer(tokens=4, fail_every=2) as stub:
        at = bench(stub.url, "--max-failure-rate", "0.5")
        below = bench(stub.url, "--max-failure-rate", "0.4")
        clean = bench(stub.url, "--max-failure-rate", "0.5", "--num-prompts", "1")
    assert at.returncode == 0, at.stderr  # 2 of 4 is not more than half
    assert below.returncode == 1, below.stderr
    assert "2 of 4 requests failed (50.0%: http_503 2)" in below.stderr, below.stderr
    assert clean.returncode == 0, clean.stderr  # the stub's 9th call: 1 request, none failed


@pytest.mark.process
def test_a_bad_threshold_is_a_usage_error(dead_url: str) -> None:
    done = bench(dead_url, "--max-failure-rate", "1.5")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "pdserve bench: error: --max-failure-rate must be a fraction in [0, 1], got 1.5"
    ]


def test_the_rule_on_summaries() -> None:
    def summary(sent: int, failed: int) -> dict[str, object]:
        return {"requests": sent, "failed": failed, "errors": {"timeout": failed}}

    assert too_many_failures(summary(10, 0), 0.0) is None
    assert too_many_failures(summary(10, 1), 0.0) == (
        "1 of 10 requests failed (10.0%: timeout 1), more than --max-failure-rate 0 allows"
    )
    assert too_many_failures(summary(10, 1), 0.1) is None
    assert too_many_failures(summary(10, 2), 0.1) is not None
    assert too_many_failures(summary(10, 10), 1.0) is None
