"""`pdserve chaos` end to end (the bounded run CI does: the storm and client disconnects here,
the kills in test_chaos_kills.py), plus its pure parts. Every process a run starts is stopped
by pid (tests/chaos/runner.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.chaos.cli import kill_range, render_summary
from pdserve.chaos.scenarios import ChaosOptions, Outcome, percentile
from pdserve.chaos.storm import summarize
from tests.chaos.runner import run_chaos


@pytest.mark.process
def test_abort_storm_end_to_end(tiny_dir: Path, tmp_path: Path):
    report = tmp_path / "chaos.json"
    done = run_chaos(
        [
            "--scenario",
            "abort-storm",
            "--rounds",
            "3",
            "--sessions",
            "60",
            "--kill-after",
            "2:4",
            "--steady-s",
            "3",
            "--model",
            str(tiny_dir),
            "--report",
            str(report),
        ],
        tmp_path / "work",
        timeout_s=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    doc = json.loads(report.read_text())
    assert doc["ok"] and doc["exit_code"] == 0 and doc["violations"] == 0
    [sc] = doc["scenarios"]
    s = sc["summary"]
    assert sc["name"] == "abort-storm" and sc["ok"] and sc["violations"] == []
    assert (s["rounds"], s["sessions"], s["wedges"], s["leaked_pages"]) == (3, 60, 0, 0)
    assert 0 < s["kill_to_deep_health_p50_s"] <= s["kill_to_deep_health_p99_s"] <= 2.0
    assert s["throughput_first_tok_s"] > 0 and s["throughput_last_tok_s"] > 0
    assert s["throughput_ratio"] == pytest.approx(
        s["throughput_last_tok_s"] / s["throughput_first_tok_s"], rel=0.01
    )
    assert s["streams_killed"] > 0 and s["requests_ok"] > 0
    # The same steady load on the fresh cluster and after the storm, compared.
    assert s["steady_fresh_tok_s"] > 0 and s["steady_after_storm_tok_s"] > 0
    assert s["steady_ratio"] == pytest.approx(
        s["steady_after_storm_tok_s"] / s["steady_fresh_tok_s"], rel=0.01
    )
    for r in sc["rounds"]:
        assert 2.0 <= r["kill_after_s"] <= 4.0
        assert r["fresh_completion"] == "ok" and r["quiet_after_s"] is not None
        assert r["client"]["in_flight"] > 0, "the kill must hit open streams"
        assert r["client"]["errors"] == {}, r["client"]["last_errors"]
    assert "abort-storm      PASS" in done.stdout and "verdict: PASS" in done.stdout
    assert done.stderr.count("round ") == 3 and "launching 1P+1D shm" in done.stderr


def test_kill_range_and_percentiles():
    assert kill_range("2:25") == (2.0, 25.0) and kill_range("3") == (3.0, 3.0)
    with pytest.raises(argparse.ArgumentTypeError):
        kill_range("soon")
    with pytest.raises(ValueError, match="MIN <= MAX"):
        ChaosOptions(kill_after=(4.0, 2.0))
    values = [0.1 * i for i in range(1, 11)]
    assert percentile(values, 50) == pytest.approx(0.5)
    assert percentile(values, 99) == pytest.approx(1.0) and percentile([], 50) is None


def test_summary_counts_wedges_and_compares_throughput():
    rounds = [
        {
            "kill_to_deep_health_s": 0.2,
            "throughput_tok_s": 400.0,
            "wedged": False,
            "leaked_pages": 0,
            "client": {"started": 10, "ok": 8, "in_flight": 2},
        },
        {
            "kill_to_deep_health_s": None,
            "throughput_tok_s": 100.0,
            "wedged": True,
            "leaked_pages": 3,
            "leaked_state_slots": 2,
            "client": {"started": 5, "ok": 5, "in_flight": 0},
        },
    ]
    s = summarize(rounds, ChaosOptions())
    assert (s["wedges"], s["leaked_pages"], s["requests"], s["streams_killed"]) == (1, 3, 15, 2)
    assert s["leaked_state_slots"] == 2
    assert s["kill_to_deep_health_p50_s"] == 0.2 and s["throughput_ratio"] == 0.25
    out = Outcome("abort-storm", violations=["round 2: wedged"], summary={"headline": "h"})
    text = render_summary([out], 1, "r.json")
    assert "abort-storm      FAIL  h" in text and "- round 2: wedged" in text
    assert text.endswith("verdict: FAIL (1 violations); report r.json")


BOUNDED = ["client-disconnect", "message-faults"]  # the kills: test_chaos_kills.py


@pytest.mark.process
@pytest.mark.timeout(600)
def test_client_disconnects_and_lost_kv_bounded_on_nixl(tiny_dir: Path, tmp_path: Path):
    """One round of client-disconnect on the nixl backend, and message-faults dropping
    KVChunk, on tcp, where it exists: lost KV must fail cleanly. (The kills and stops are
    test_chaos_kills.py's, a file of their own so that the two run side by side.)"""
    report = tmp_path / "chaos.json"
    args = [f"--scenario={name}" for name in BOUNDED]
    args += ["--backend", "nixl", "--rounds", "1", "--sessions", "20", "--kill-after", "1:2"]
    args += ["--messages", "KVChunk", "--model", str(tiny_dir), "--report", str(report)]
    done = run_chaos(args, tmp_path / "work", timeout_s=540)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    by_name = {sc["name"]: sc for sc in json.loads(report.read_text())["scenarios"]}
    assert sorted(by_name) == sorted(BOUNDED)
    for name, sc in by_name.items():
        assert sc["ok"] and sc["skipped"] is None and sc["violations"] == [], name

    disconnects = by_name["client-disconnect"]
    assert " nixl " in f" {disconnects['cluster']} "
    rounds = disconnects["rounds"]
    assert [r["state"] for r in rounds] == ["pending", "prefilling", "kv-done", "decoding"]
    assert all(r["seen"] and r["quiet_after_s"] is not None for r in rounds)

    faults = by_name["message-faults"]["rounds"]
    assert [r["message"] for r in faults] == ["KVChunk"]
    assert [r["backend"] for r in faults] == ["tcp"]


def test_no_disconnect_prompt_shares_a_cached_page_with_another() -> None:
    """client-disconnect's *prefilling* needs P to compute and write every chunk of its
    prompt: with a page of an earlier disconnect's prompt in the prefix cache, round 2 found
    P writing once and never saw the state (`chaos --rounds 2` failed). Each disconnect's
    prompt spans three prefill chunks and shares no page key with any other's."""
    from pdserve.chaos.disconnects import PROMPT_LEN, prompt
    from pdserve.protocol.page_keys import page_keys

    assert PROMPT_LEN > 2 * 512  # three chunks of the default step budget
    seen: set[int] = set()
    for n in range(4 * 5):  # five rounds over the four states
        keys = set(page_keys(prompt(n), 1))  # page size 1: no shared first token either
        assert len(prompt(n)) == PROMPT_LEN and not keys & seen, n
        seen |= keys


def test_a_taken_state_slot_is_counted_as_leaked():
    from pdserve.chaos.probes import Quiet

    pool = {"pages_total": 4, "pages_free": 4, "state_slots": 8, "state_slots_free": 7}
    q = Quiet(False, 30.0, workers={"http://w": {"pool": pool}}, violations=["x"])
    assert (q.leaked_pages, q.leaked_state_slots) == (0, 1)
    assert Quiet(True, 0.1, workers={"http://w": {"pool": pool}}).leaked_state_slots == 0
