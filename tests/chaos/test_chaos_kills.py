"""`pdserve chaos`'s kills and stops end to end, one round each on the nixl backend: a file of
its own so that it runs beside test_chaos.py's scenarios (each launches its clusters and mostly
waits). Every process a run starts is stopped by pid (tests/chaos/runner.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.chaos.runner import run_chaos

KILLS = ["prefill-kill", "prefill-stop", "decode-kill", "thread-crash", "thread-kill"]


@pytest.mark.process
@pytest.mark.timeout(600)
def test_every_kill_and_stop_bounded_on_nixl(tiny_dir: Path, tmp_path: Path):
    report = tmp_path / "chaos.json"
    args = [f"--scenario={name}" for name in KILLS]
    args += ["--backend", "nixl", "--rounds", "1", "--sessions", "20", "--kill-after", "1:2"]
    args += ["--model", str(tiny_dir), "--report", str(report)]
    done = run_chaos(args, tmp_path / "work", timeout_s=540)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    by_name = {sc["name"]: sc for sc in json.loads(report.read_text())["scenarios"]}
    assert sorted(by_name) == sorted(KILLS)
    for name, sc in by_name.items():
        assert sc["ok"] and sc["skipped"] is None and sc["violations"] == [], name
        assert " nixl " in f" {sc['cluster']} ", (name, sc["cluster"])

    [stop] = by_name["prefill-stop"]["rounds"]
    assert stop["deep_health_after_s"] is not None
    assert stop["deep_health_after_resume_s"] is not None
    assert stop["fences_released_after_s"] is not None and stop["leaked_pages"] == 0
    assert stop["client"]["finished"] and "hung" not in stop["client"]["errors"]

    for kill in ("prefill-kill", "decode-kill"):
        [r] = by_name[kill]["rounds"]
        assert r["deep_health_after_s"] is not None and r["fresh_failed"] == [], kill
        assert r["quiet_after_s"] is not None and r["leaked_pages"] == 0, kill
        assert r["client"]["max_request_s"] <= 15.0 + 5.0, kill

    kills = by_name["thread-kill"]["rounds"]
    restarted = {(r["role"], r["thread"]) for r in kills if r["restart"]}
    assert {("prefill", "engine"), ("prefill", "control"), ("prefill", "dataplane")} <= restarted
    assert {("decode", "engine"), ("decode", "control")} <= restarted
    for_good = [r for r in kills if not r["restart"]]
    assert [(r["role"], r["thread"]) for r in for_good] == [
        ("prefill", "control"),
        ("decode", "engine"),
    ]
    assert all(r["ok"] and r["exit_code"] not in (None, 0) for r in for_good), for_good

    [crash] = by_name["thread-crash"]["rounds"]
    assert crash["red_at_heartbeat_age_s"] is not None and crash["quiet_after_s"] is not None
