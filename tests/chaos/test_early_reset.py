"""`pdserve chaos --scenario early-reset` end to end, as CI runs it (LESSONS #17): storms of
clients that reset their connection right after sending, after the response head or after the
first token, against a 1P+1D cluster's router, and against a co-located cluster's router and
its worker's own front end. Every worker must be quiet 2 s after each storm (no request, no
room, every page free) and a fresh request answered within 1 s; the run's processes are
stopped by pid whatever happens (tests/chaos/test_chaos.run_chaos)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.chaos.test_chaos import run_chaos

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

RESETS = 600  # per storm: a CI-sized storm; benchmarks/RESULTS.md has the 3,000 ones


@pytest.mark.parametrize("prefill, targets", [(1, ["router"]), (0, ["router", "co-located"])])
def test_early_reset_storms_leave_nothing_behind(tiny_dir: Path, tmp_path: Path, prefill, targets):
    report = tmp_path / "chaos.json"
    done = run_chaos(
        [
            "--scenario",
            "early-reset",
            "--rounds",
            "1",
            "--resets",
            str(RESETS),
            "--prefill",
            str(prefill),
            "--model",
            str(tiny_dir),
            "--report",
            str(report),
        ],
        tmp_path / "work",
        timeout_s=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    doc = json.loads(report.read_text())
    [sc] = doc["scenarios"]
    assert sc["name"] == "early-reset" and sc["ok"] and sc["violations"] == []
    assert [r["target"].split(" ")[0] for r in sc["rounds"]] == targets
    for r in sc["rounds"]:
        assert sum(n for w, n in r["resets"].items() if not w.startswith("failed")) == RESETS
        assert r["quiet_after_s"] <= 2.0 and r["fresh_s"] <= 1.0 and r["ok"]
