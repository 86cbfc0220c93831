"""Whether PD happens, shown end to end on `pdserve launch --prefill 1 --decode 1`.

Requests through the router count on the router (`mode="pd"`), on D (`prefill="remote"`, one
KV-bytes, transfer and wait observation each) and on P (one export done each), exactly;
`pdserve bench` reports them as its PD block. A request sent to D with no prefill address
is prefilled by D itself and doctor names it. With the prefill worker stopped the router
does not fall back to decode-only: it refuses (by design, router/registry.py `choose`).
The tests run in this order on one cluster; the last stops its prefill worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.runtime.pids import wait_gone
from tests.procs import LaunchedCluster, http

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

TOOL_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedCluster]:
    flags = ["--model", str(tiny_dir), "--served-model-name", "tiny", "--kv-budget-mb", "16"]
    flags += ["--max-model-len", "1024", "--threads", "1", "--backend", "shm"]
    args = ["launch", "--prefill", "1", "--decode", "1", "--on-worker-exit", "continue", *flags]
    with LaunchedCluster(args, tmp_path_factory.mktemp("pd-visibility")) as c:
        yield c


def urls(c: LaunchedCluster) -> tuple[str, str, str]:
    return c.url, c.processes["prefill-0"]["url"], c.processes["decode-0"]["url"]


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of `url`/metrics: (name, sorted labels) -> value."""
    status, text = http("GET", url + "/metrics")
    assert status == 200, text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def completion(url: str, prompt: str) -> tuple[int, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    return http("POST", url + "/v1/completions", body)


def doctor(url: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "doctor", "--url", url, "--json"],
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT_S,
    )
    assert done.returncode != 3, done.stdout + done.stderr
    return dict(json.loads(done.stdout))


COUNTED = [  # (which process, sample name, labels): what one PD request adds to each
    ("router", "pdserve_router_routed_requests_total", {"mode": "pd"}),
    ("d", "pdserve_pd_requests_total", {"prefill": "remote"}),
    ("d", "pdserve_pd_kv_bytes_count", {}),
    ("d", "pdserve_pd_kv_transfer_seconds_count", {}),
    ("d", "pdserve_pd_kv_wait_seconds_count", {}),
    ("p", "pdserve_pd_exports_total", {"outcome": "done"}),
]
UNCOUNTED = [
    ("router", "pdserve_router_routed_requests_total", {"mode": "decode_only"}),
    ("d", "pdserve_pd_requests_total", {"prefill": "local"}),
    ("p", "pdserve_pd_exports_total", {"outcome": "failed"}),
]


def read_all(c: LaunchedCluster) -> dict[str, dict[Any, float]]:
    router, p, d = urls(c)
    return {"router": metrics(router), "p": metrics(p), "d": metrics(d)}


def delta(before: dict[str, Any], after: dict[str, Any], where: str, name: str, labels) -> float:
    return value(after[where], name, **labels) - value(before[where], name, **labels)


def test_pd_requests_count_exactly_on_router_d_and_p(cluster: LaunchedCluster) -> None:
    before = read_all(cluster)
    n = 3
    for i in range(n):
        status, body = completion(cluster.url, f"request {i} " * (5 + 10 * i))  # 1 to 4 pages
        assert status == 200, body
    after = read_all(cluster)  # D observed each before its first token left: no wait needed
    for where, name, labels in COUNTED:
        assert delta(before, after, where, name, labels) == n, (where, name, labels)
    for where, name, labels in UNCOUNTED:
        assert delta(before, after, where, name, labels) == 0, (where, name, labels)
    kv = delta(before, after, "d", "pdserve_pd_kv_bytes_sum", {})
    assert kv > 0 and kv == delta(before, after, "p", "pdserve_pd_export_bytes_total", {})
    d_identity = http("GET", urls(cluster)[2] + "/info")[1]["identity"]  # P's label for D
    assert (
        "pdserve_pd_exports_outstanding",
        (("decode", d_identity),),
    ) in after["p"]
    assert value(after["p"], "pdserve_pd_exports_outstanding", decode=d_identity) == 0


def test_bench_reports_the_routers_pd_block(cluster: LaunchedCluster, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    argv = [sys.executable, "-m", "pdserve", "bench", "--url", cluster.url, "--no-progress"]
    argv += ["--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--warmup", "1"]
    done = subprocess.run(
        [*argv, "--out", str(out)], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    pd = json.loads(out.read_text())["pd"]
    assert pd["routed"] == {"pd": 4, "decode_only": 0, "colocated": 0}  # warm-up included
    assert pd["decode_only_fraction"] == 0.0 and pd["warmup_requests"] == 1
    assert "---- PD (router, warm-up's 1 included) ----" in done.stdout
    assert "requests routed decode-only" in done.stdout


def test_a_request_d_prefills_itself_is_counted_and_doctor_names_it(
    cluster: LaunchedCluster,
) -> None:
    router, _, d = urls(cluster)
    before = read_all(cluster)
    body = {"request_id": "direct-1", "prompt_ids": [5, 6, 7, 8, 9], "params": {"max_tokens": 2}}
    status, answer = http("POST", d + "/generate", body)  # no "prefill": D computes the prompt
    assert status == 200, answer
    after = read_all(cluster)
    assert delta(before, after, "d", "pdserve_pd_requests_total", {"prefill": "local"}) == 1
    assert delta(before, after, "d", "pdserve_pd_requests_total", {"prefill": "remote"}) == 0
    assert delta(before, after, "d", "pdserve_pd_kv_bytes_count", {}) == 0
    # The router routed nothing decode-only: the request never went through it.
    name, labels = "pdserve_router_routed_requests_total", {"mode": "decode_only"}
    assert delta(before, after, "router", name, labels) == 0

    report = doctor(router)
    assert report["code"] == 1, report
    [finding] = [f for f in report["findings"] if "decode-only" in f["what"]]
    assert finding["severity"] == "degraded" and finding["where"].startswith(f"decode worker {d}")
    assert finding["what"].startswith("1 of ") and "prefilled here, decode-only" in finding["what"]


def test_with_the_prefill_worker_stopped_the_router_refuses_rather_than_serve_decode_only(
    cluster: LaunchedCluster,
) -> None:
    router, p, d = urls(cluster)
    before = read_all(cluster)
    pid = int(cluster.processes["prefill-0"]["pid"])
    os.kill(pid, signal.SIGTERM)  # the launcher goes on (--on-worker-exit continue)
    assert wait_gone([pid], 30.0) == [], "the prefill worker did not stop"
    deadline = time.monotonic() + 15.0
    while p in http("GET", router + "/health")[1]["in_rotation"]:
        assert time.monotonic() < deadline, "the router kept the stopped prefill worker"
        time.sleep(0.2)

    status, body = completion(router, "no prefill worker left")
    assert status != 200, body
    assert "no healthy prefill" in json.dumps(body), body
    after = {"router": metrics(router), "d": metrics(d)}
    name = "pdserve_router_requests_total"
    assert delta(before, after, "router", name, {"outcome": "rejected"}) == 1
    for mode in ("pd", "decode_only"):
        labels = {"mode": mode}
        assert delta(before, after, "router", "pdserve_router_routed_requests_total", labels) == 0
    assert delta(before, after, "d", "pdserve_pd_requests_total", {"prefill": "local"}) == 0

    report = doctor(router)
    assert report["code"] == 2, report
    whats = [(f["where"], f["what"]) for f in report["findings"]]
    assert ("cluster", "no (prefill, decode) pair is usable: it cannot serve") in whats
    assert not [w for w in whats if w[0] == "router" and "decode-only" in w[1]], whats
