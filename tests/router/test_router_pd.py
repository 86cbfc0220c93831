"""The router over prefill/decode workers: `pdserve launch --prefill 1 --decode 1`.

The same contract as over co-located workers: greedy answers equal the co-located server's
(the conftest `tiny_server`), deep health goes through the real (P, D) pair, and a client
that disconnects leaves both workers quiet (no request, no room, every page free).
"""

from __future__ import annotations

import http.client as httpclient
import json
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.procs import LaunchedCluster, http

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


@pytest.fixture(scope="module")
def pd_cluster(
    tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LaunchedCluster]:
    flags = [
        "--model",
        str(tiny_dir),
        "--served-model-name",
        "tiny",
        "--kv-budget-mb",
        "16",
        "--max-model-len",
        "1024",
        "--threads",
        "1",
        "--backend",
        "shm",
    ]
    with LaunchedCluster(
        ["launch", "--prefill", "1", "--decode", "1", *flags], tmp_path_factory.mktemp("router-pd")
    ) as c:
        yield c


def completion(url: str, prompt: str, **kw: object) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, **kw}
    status, resp = http("POST", url + "/v1/completions", body)
    assert status == 200, resp
    return resp


def test_pd_answers_equal_the_colocated_server(pd_cluster, tiny_server):
    for prompt in ["def main():", "The quick brown fox " * 8]:  # the second spans pages
        want = completion(tiny_server.url, prompt)["choices"][0]["text"]
        assert completion(pd_cluster.url, prompt)["choices"][0]["text"] == want


def test_pd_deep_health_goes_through_the_pair(pd_cluster):
    status, body = http("GET", pd_cluster.url + "/health/deep")
    assert status == 200 and body["ok"], body
    [pair] = body["pairs"]
    assert (pair["prefill"], pair["decode"]) == (
        pd_cluster.processes["prefill-0"]["url"],
        pd_cluster.processes["decode-0"]["url"],
    )


def test_pd_disconnect_leaves_both_workers_quiet(pd_cluster):
    u = urlparse(pd_cluster.url)
    conn = httpclient.HTTPConnection(u.hostname, u.port, timeout=30)
    body = {
        "model": "tiny",
        "prompt": "abc " * 40,
        "max_tokens": 800,
        "stream": True,
        "ignore_eos": True,
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    workers = [pd_cluster.processes[n]["url"] for n in ("prefill-0", "decode-0")]
    assert http("GET", workers[1] + "/debug/state")[1]["engine"]["requests"], "still running"
    conn.sock.close()
    conn.close()
    # 800 tokens take several seconds here; only an abort ends it within the bound.
    deadline = time.monotonic() + 2.0
    while True:
        inv = [http("GET", w + "/debug/invariants")[1] for w in workers]
        if all(i["ok"] for i in inv):
            break
        assert time.monotonic() < deadline, inv
        time.sleep(0.02)
    assert completion(pd_cluster.url, "still fine", max_tokens=2)["choices"][0]["text"] is not None


def test_pd_tiny_timeouts_are_the_clients_408_never_a_500(pd_cluster):
    """`"timeout": 0.001` in PD mode (issue 41 item 6): the deadline passes in every state of
    the request (waiting for pages, on its way to P, prefilling, decoding), and each answer
    is a 200 or the client's 408, with an OpenAI body; both workers end quiet."""
    timeouts = [1e-9, 1e-6, 1e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1]
    bodies = [
        {"model": "tiny", "prompt": "tick " * n, "max_tokens": 16, "timeout": t}
        for t in timeouts
        for n in (1, 2, 40, 300) * 3
    ]
    with ThreadPoolExecutor(32) as pool:  # many at once: some wait for D's pages, or for P
        answers = list(
            pool.map(lambda b: http("POST", pd_cluster.url + "/v1/completions", b), bodies)
        )
    statuses = Counter(status for status, _ in answers)
    assert set(statuses) <= {200, 408}, [a for a in answers if a[0] not in (200, 408)]
    assert statuses[408] > 0, statuses
    for status, body in answers:
        if status == 408:
            assert set(body["error"]) == {"message", "type", "param", "code"}, body
            assert body["error"]["code"] == "timeout", body
    workers = [pd_cluster.processes[n]["url"] for n in ("prefill-0", "decode-0")]
    deadline = time.monotonic() + 10.0
    while not all(http("GET", w + "/debug/invariants")[1]["ok"] for w in workers):
        assert time.monotonic() < deadline, "the workers did not come quiet"
        time.sleep(0.05)
