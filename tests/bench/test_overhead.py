"""`pdserve bench` against a stub that answers instantly: how many requests/s the client drives.

The figure is printed (run with -s to see it), never asserted: timing on a shared machine is
not a test result. What is asserted is that 2000 requests sent at once all complete and are
counted exactly. benchmarks/serving/bench_overhead.py records the figure in RESULTS.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.stub import StubServer

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

TOKENS = 8
PROMPTS = 2000


def test_client_drives_2000_requests_at_once(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    with StubServer(tokens=TOKENS) as stub:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve",
                "bench",
                "--url",
                stub.url,
                "--request-rate",
                "inf",
                "--num-prompts",
                str(PROMPTS),
                "--input-len",
                "16",
                "--output-len",
                str(TOKENS),
                "--no-progress",
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert (summary["completed"], summary["failed"]) == (PROMPTS, 0), summary["errors"]
    assert summary["output_tokens"] == PROMPTS * TOKENS
    assert summary["itl_ms"]["count"] == PROMPTS * (TOKENS - 1)
    print(
        f"\nbench client overhead: {summary['request_throughput']:.0f} requests/s "
        f"({PROMPTS} requests at once, {TOKENS} chunks each, stub in the test process)"
    )
