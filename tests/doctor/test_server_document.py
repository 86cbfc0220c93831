"""Doctor on one server read without a router: the server document, and what is refused.

The document is what source.py builds from a server's /debug/state and /info; the states
come from clusterdocs.py, in the shape a worker's /debug/state has.
"""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.doctor.diagnosis import Severity, diagnose
from pdserve.doctor.source import Unreadable, check
from tests.doctor.clusterdocs import cluster, d_room, request, state, thread

NOW = 1_800_000_000.0
URL = "http://127.0.0.1:1004"


def server_doc(s: dict[str, Any]) -> dict[str, Any]:
    return {"server": {"url": URL, "info": {"role": s["role"], "pid": 44}}, "state": s}


def colocated(**kw: Any) -> dict[str, Any]:
    return state("colocated", threads=kw.pop("threads", [thread("engine", timeout=30)]), **kw)


def test_an_idle_colocated_server_is_healthy() -> None:
    result = diagnose(server_doc(colocated()), NOW)
    assert result.code == 0 and result.findings == []
    assert result.lines()[:2] == [
        f"co-located server {URL} (pid 44), up 0s, read directly (no router)",
        f"co-located server {URL} (pid 44): healthy; 0 requests, 0 rooms, "
        "0 waiting for pages, 0/100 pages used",
    ]


def test_a_stale_engine_with_a_request_behind_it_is_wedged() -> None:
    s = colocated(threads=[thread("engine", age=45.0, timeout=30)], requests=[request("r1")])
    result = diagnose(server_doc(s), NOW)
    assert result.code == Severity.WEDGED
    assert "thread engine stale or dead, with 1 live requests/rooms behind it" in result.verdict()


def test_a_request_past_its_deadline_is_wedged_and_leaked_pages_degraded() -> None:
    late = colocated(requests=[request("late", in_state=70.0, left=-9.5)])
    assert diagnose(server_doc(late), NOW).code == 2
    leaked = colocated(requests=[request("r", pages=3)], pages_used=10)
    result = diagnose(server_doc(leaked), NOW)
    assert result.code == 1 and "7 pages in use that no live request" in result.verdict()


def test_unhealthy_with_no_other_finding_is_degraded() -> None:
    s = colocated()
    s["problems"] = ["engine loop has not ticked for 31.0s"]
    result = diagnose(server_doc(s), NOW)
    assert result.code == 1
    assert "its /health says unhealthy: engine loop has not ticked for 31.0s" in result.verdict()


def test_a_worker_read_alone_says_its_peers_were_not_checked() -> None:
    d = state("decode", rooms=[d_room(3, "r3", "prefilling")])
    result = diagnose(server_doc(d), NOW)
    assert result.code == 0
    assert [f.severity for f in result.findings] == [Severity.NOTE]
    assert "peers were not checked" in result.findings[0].what
    assert result.workers[0].startswith(f"decode worker {URL} (pid 44): healthy; 0 requests")


@pytest.mark.parametrize(
    "doc",
    [{}, [], "text", {"router": "x"}, {"server": {"url": URL}}, {"state": {}}, {"workers": {}}],
)
def test_anything_else_is_unreadable_not_healthy(doc: Any) -> None:
    with pytest.raises(Unreadable):
        check(doc)


def test_both_shapes_pass_the_check() -> None:
    assert check(cluster()) is not None
    assert check(server_doc(colocated())) is not None
