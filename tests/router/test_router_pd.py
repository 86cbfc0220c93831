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
    d = http("GET", workers[1] + "/debug/state")[1]["engine"]
    # Decoding, or (its first token streamed ahead of its KV: FirstToken) still in its room.
    assert d["requests"] or d["role"]["rooms"], "still running"
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


def test_pd_router_serves_vllms_endpoints_as_the_colocated_server(pd_cluster, tiny_server):
    """/tokenize, /detokenize, /version and /ping on the router (it holds the tokenizer), the
    same answers as a co-located server's; an unknown path is an OpenAI-style 404 even though
    the router holds a cluster key (no API key is set)."""
    calls = [
        ("POST", "/tokenize", {"prompt": "hello world", "return_token_strs": True}),
        ("POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/detokenize", {"tokens": [5, 6, 7]}),
        ("GET", "/version", None),
        ("POST", "/tokenize", {"prompt": 5}),
    ]
    for method, path, body in calls:
        want = http(method, tiny_server.url + path, body, auth=False)
        assert http(method, pd_cluster.url + path, body, auth=False) == want, path
    for method in ("GET", "POST"):
        assert http(method, pd_cluster.url + "/ping", auth=False)[0] == 200
    for path in ("/no/such/path", "/v1/nothing", "/debug/nothing"):
        status, body = http("GET", pd_cluster.url + path, auth=False)
        assert status == 404 and body["error"]["type"] == "invalid_request_error", (path, body)


def test_pd_prompt_logprobs_and_context_errors_equal_colocated(pd_cluster, tiny_server):
    """prompt_logprobs come from P through D (PrefillDone) as co-located computes them; a
    prompt past the context is the same vLLM-worded 400 on both."""
    body = {"prompt": "def main():", "prompt_logprobs": 2, "return_tokens_as_token_ids": True}
    want = completion(tiny_server.url, **body)["choices"][0]["prompt_logprobs"]
    got = completion(pd_cluster.url, **body)["choices"][0]["prompt_logprobs"]
    assert want[0] is None and len(want) > 3
    assert [p and sorted(p) for p in got] == [p and sorted(p) for p in want]
    for g, w in zip(got[1:], want[1:], strict=True):
        for k in w:
            assert abs(g[k]["logprob"] - w[k]["logprob"]) < 1e-3 and g[k]["rank"] == w[k]["rank"]
    too_long = {"model": "tiny", "prompt": "x", "max_tokens": 1024}
    answers = [
        http("POST", u + "/v1/completions", too_long) for u in (tiny_server.url, pd_cluster.url)
    ]
    assert answers[0] == answers[1] and answers[0][0] == 400
    assert answers[0][1]["error"]["code"] == "context_length_exceeded"
