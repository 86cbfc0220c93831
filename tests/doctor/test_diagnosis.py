"""Doctor's analysis over hand-written cluster documents: exact codes, findings in words."""

from __future__ import annotations

import json

from pdserve.cli import main
from pdserve.doctor.diagnosis import Severity, diagnose
from tests.doctor.clusterdocs import (
    D2_URL,
    D_IDENTITY,
    D_URL,
    P_URL,
    cluster,
    d_room,
    request,
    row,
    state,
    thread,
)

NOW = 1_800_000_000.0


def text(doc: dict) -> str:
    return "\n".join(diagnose(doc, NOW).lines())


def test_a_healthy_idle_cluster_is_healthy():
    result = diagnose(cluster(), NOW)
    assert result.code == 0 and result.findings == []
    assert result.verdict().startswith("VERDICT: healthy")
    assert any(
        line.startswith(f"decode worker {D_URL} (pid 12): healthy, in rotation")
        for line in result.lines()
    )


def test_busy_but_on_time_work_is_healthy():
    d = state("decode", requests=[request("r1")], rooms=[d_room(5, "r2", "prefilling")])
    p = state("prefill", requests=[request(f"{D_IDENTITY}:5:1", "prefilling")])
    assert diagnose(cluster(p=p, d=d), NOW).code == 0


def test_stale_control_thread_with_a_stuck_room_is_wedged_and_named():
    d = state(
        "decode",
        threads=[thread("engine", timeout=30), thread("control", age=12.5)],
        rooms=[d_room(77, "chatcmpl-abc", "pending", in_state=11.0, left=40.0)],
    )
    result = diagnose(cluster(d=d), NOW)
    out = "\n".join(result.lines())
    assert result.code == 2
    assert "thread control is stale: no heartbeat for 12.5s" in out
    assert "room 77 (request chatcmpl-abc" in out and "stuck: thread control" in out
    assert result.verdict().startswith("VERDICT: wedged") and D_URL in result.verdict()


def test_a_room_waiting_on_a_peer_whose_control_thread_is_stale_is_wedged():
    p = state("prefill", threads=[thread("engine", timeout=30), thread("control", age=20.0)])
    d = state("decode", rooms=[d_room(9, "r9", "pending", in_state=4.0)])
    result = diagnose(cluster(p=p, d=d), NOW)
    wedged = [f for f in result.findings if f.severity == Severity.WEDGED]
    assert result.code == 2 and len(wedged) == 1
    assert "room 9 (request r9" in wedged[0].what and P_URL in wedged[0].what
    assert "thread control stale or dead" in wedged[0].what


def test_work_past_its_deadline_is_wedged():
    d = state("decode", requests=[request("late", "running", in_state=70.0, left=-9.5)])
    result = diagnose(cluster(d=d), NOW)
    assert result.code == 2
    assert "request late in state running for 70.0s: 9.5s past its deadline" in text(cluster(d=d))
    # One engine step of lateness is not a wedge: deadlines are applied once per step.
    d = state("decode", requests=[request("just", left=-0.3)])
    assert diagnose(cluster(d=d), NOW).code == 0


def test_a_stale_thread_without_work_is_degraded_and_says_since_when():
    d = state("decode", threads=[thread("engine", timeout=30), thread("control", age=8.0)])
    result = diagnose(cluster(d=d), NOW)
    assert result.code == 1
    assert "(since " in text(cluster(d=d)) and "limit 5s" in text(cluster(d=d))


def test_a_dead_thread_reports_its_reason_and_last_error():
    dead = thread(
        "engine",
        age=3.0,
        timeout=30,
        alive=False,
        crashes=6,
        last_error="RuntimeError: boom",
        dead_reason="restart budget exhausted",
    )
    d = state("decode", threads=[dead, thread("control")], requests=[request("r", in_state=3.0)])
    out = text(cluster(d=d))
    assert diagnose(cluster(d=d), NOW).code == 2  # dead engine with a live request
    assert "thread engine is dead" in out and "restart budget exhausted" in out
    assert "RuntimeError: boom" in out and "6 crashes" in out


def test_an_engine_that_does_not_answer_is_wedged():
    d = state("decode")
    d["engine"] = {"error": "the engine thread did not answer within 2 s"}
    result = diagnose(cluster(d=d), NOW)
    assert result.code == 2 and "engine thread does not answer" in text(cluster(d=d))


def test_unreachable_worker_is_degraded_while_another_pair_serves():
    rows = [
        row(P_URL, "prefill", 11),
        row(D_URL, "decode", 12),
        row(
            D2_URL,
            "decode",
            13,
            healthy=False,
            in_rotation=False,
            last_error="GET /health: cannot connect",
        ),
    ]
    pairs = [
        {"prefill": P_URL, "decode": D_URL, "ok": True, "usable": True, "error": None},
        {"prefill": P_URL, "decode": D2_URL, "ok": False, "usable": False, "error": "refused"},
    ]
    doc = cluster(
        rows=rows, pairs=pairs, extra={D2_URL: {"role": "decode", "error": "cannot connect"}}
    )
    result = diagnose(doc, NOW)
    assert result.code == 1
    out = text(doc)
    assert f"decode worker {D2_URL} (pid 13): UNREACHABLE (cannot connect)" in out
    assert "out of rotation: GET /health: cannot connect" in out
    assert "deep health fails: refused" in out


def test_no_usable_pair_is_wedged_even_if_every_worker_answers_something():
    rows = [row(P_URL, "prefill", 11), row(D_URL, "decode", 12, healthy=False, in_rotation=False)]
    pairs = [{"prefill": P_URL, "decode": D_URL, "ok": False, "usable": False, "error": "x"}]
    doc = cluster(rows=rows, pairs=pairs, d={"error": "cannot connect"})
    result = diagnose(doc, NOW)
    assert result.code == 2 and "cannot serve" in result.verdict()


def test_a_room_of_a_dead_prefill_worker_is_degraded_until_its_fence_expires():
    pairs = [{"prefill": P_URL, "decode": D_URL, "ok": False, "usable": False, "error": "x"}]
    fenced = state("decode", rooms=[d_room(4, "r4", "fenced", in_state=6.0, left=8.0)])
    waiting = state("decode", rooms=[d_room(4, "r4", "pending", in_state=3.0, left=50.0)])
    both = [{"prefill": P_URL, "decode": D_URL, "ok": True, "usable": True, "error": None}]
    assert diagnose(cluster(p={"error": "refused"}, d=fenced, pairs=both), NOW).code == 1
    result = diagnose(cluster(p={"error": "refused"}, d=waiting, pairs=both), NOW)
    assert result.code == 1 and "its peer" in text(cluster(p={"error": "x"}, d=waiting))
    assert diagnose(cluster(p={"error": "refused"}, d=fenced, pairs=pairs), NOW).code == 2


def test_pages_that_nobody_holds_are_leaked():
    d = state("decode", requests=[request("r", pages=3)], pages_used=10)
    result = diagnose(cluster(d=d), NOW)
    assert result.code == 1 and "7 pages in use that no live request or room holds" in text(
        cluster(d=d)
    )


def test_doctor_cli_reads_a_saved_document_and_exits_with_the_code(tmp_path, capsys):
    d = state(
        "decode",
        threads=[thread("engine", timeout=30), thread("control", age=9.0)],
        rooms=[d_room(3, "stuck-req", in_state=8.0)],
    )
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster(d=d)))
    assert main(["doctor", "--file", str(path)]) == 2
    out = capsys.readouterr().out
    assert "stuck-req" in out and "thread control" in out and "VERDICT: wedged" in out
    assert main(["doctor", "--file", str(path), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["code"] == 2
    assert main(["doctor", "--file", str(tmp_path / "missing.json")]) == 3
    assert main(["doctor", "--url", "http://127.0.0.1:9", "--timeout", "2"]) == 3
    assert "cannot read the cluster" in capsys.readouterr().out
