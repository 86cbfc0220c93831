"""`pdserve bench` against real pdserve servers on the tiny model.

The report's numbers are recomputed here from the per-request records it wrote, with numpy,
so that the summary and the records cannot disagree. A server SIGKILLed mid-run ends the run
with its failures counted by kind, not a hang.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.procs import ServerProcess

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

BENCH_TIMEOUT_S = 120.0


def bench_argv(url: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pdserve", "bench", "--url", url, "--out", str(out), *extra]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000.0, q))


def test_report_agrees_with_its_records(tiny_server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    argv = bench_argv(
        tiny_server.url,
        out,
        *("--num-prompts", "24", "--request-rate", "8", "--seed", "5"),
        *("--input-len", "64", "--output-len", "16", "--range-ratio", "0.5"),
        *("--slo", "ttft:300", "tpot:100", "--no-progress"),
    )
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "request throughput" in proc.stdout
    doc = json.loads(out.read_text())
    s, recs = doc["summary"], doc["records"]
    ok = [r for r in recs if r["error"] is None]

    assert doc["model"] == "tiny"
    assert s["requests"] == len(recs) == 24
    assert s["completed"] == len(ok) == 24
    assert s["errors"] == dict(Counter(r["error"] for r in recs if r["error"]))
    for r in ok:  # ignore_eos and token-id prompts: the server did exactly what was asked
        assert r["output_tokens"] == r["target_output_len"]
        assert r["prompt_tokens"] == r["prompt_len"]
        assert 1 <= len(r["itl"]) + 1 <= r["output_tokens"]
        assert r["start"] + r["latency"] <= s["duration_s"]
    assert sorted(r["index"] for r in recs) == list(range(24))

    ttft = [r["ttft"] for r in ok]
    itl = [g for r in ok for g in r["itl"]]
    tpot = [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok]
    e2el = [r["latency"] for r in ok]
    for key, values in (("ttft_ms", ttft), ("itl_ms", itl), ("tpot_ms", tpot), ("e2el_ms", e2el)):
        assert s[key]["mean"] == pytest.approx(1000.0 * float(np.mean(values)))
        assert s[key]["median"] == pytest.approx(pct(values, 50))
        assert s[key]["p90"] == pytest.approx(pct(values, 90))
        assert s[key]["p99"] == pytest.approx(pct(values, 99))
        assert s[key]["count"] == len(values)

    tokens = sum(r["output_tokens"] for r in ok)
    assert s["output_tokens"] == tokens
    assert s["output_throughput"] == pytest.approx(tokens / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(len(ok) / s["duration_s"])
    good = sum(1 for r, t in zip(ok, tpot, strict=True) if r["ttft"] <= 0.3 and t <= 0.1)
    assert s["goodput"]["good_requests"] == good
    assert s["goodput"]["requests_per_s"] == pytest.approx(good / s["duration_s"])


def test_killed_server_ends_the_run_with_errors_by_kind(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "killed.json"
    server = ServerProcess(
        ["serve", "--model", str(tiny_dir), "--served-model-name", "tiny", "--threads", "1"],
        tmp_path / "serve.log",
    )
    bench: subprocess.Popen[str] | None = None
    try:
        server.__enter__()
        argv = bench_argv(
            server.url,
            out,
            *("--num-prompts", "200", "--max-concurrency", "4"),
            *("--input-len", "32", "--output-len", "32"),
        )
        bench = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        progress = _ProgressWatch(bench)
        assert progress.wait_done(5, timeout_s=60.0), progress.text()
        os.kill(server.pid, signal.SIGKILL)  # mid-run: 4 streams in flight, ~190 to go
        stdout, _ = bench.communicate(timeout=BENCH_TIMEOUT_S)
        assert bench.returncode == 1, progress.text()  # requests failed: bench says so
    finally:
        if bench is not None and bench.poll() is None:
            bench.kill()
            bench.wait(10)
        server.stop()
    doc = json.loads(out.read_text())
    s = doc["summary"]
    failed = [r for r in doc["records"] if r["error"] is not None]
    print(f"\nafter SIGKILL: {s['completed']} completed, errors {s['errors']}")
    assert s["requests"] == 200 and s["completed"] + s["failed"] == 200
    assert s["completed"] >= 5 and s["failed"] >= 1
    assert s["errors"] == dict(Counter(r["error"] for r in failed))
    # The streams cut by the kill and the requests refused after it are connection errors.
    assert set(s["errors"]) == {"connection"}, s["errors"]
    assert all(r["error_detail"] for r in failed)


class _ProgressWatch:
    """Reads bench's stderr in a thread; `wait_done(n)` waits for a progress line >= n."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.done = 0
        self._changed = threading.Condition()
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            with self._changed:
                self.lines.append(line)
                m = re.match(r"bench: (\d+)/", line)
                if m:
                    self.done = int(m.group(1))
                self._changed.notify_all()

    def wait_done(self, n: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self.done < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def text(self) -> str:
        return "".join(self.lines[-50:])

    def __repr__(self) -> str:
        return f"_ProgressWatch(done={self.done})"
