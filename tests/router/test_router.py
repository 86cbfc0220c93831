"""The router over a real cluster: `pdserve launch --prefill 0 --decode 2` on the tiny model.

A co-located `pdserve serve` with the same flags is the reference: through the router the
OpenAI API must answer exactly as it does. The test that SIGKILLs a worker runs last.
"""

from __future__ import annotations

import http.client as httpclient
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest

from pdserve.runtime.pids import wait_gone
from tests.procs import LaunchedCluster, ServerProcess, http
from tests.server.test_api import BAD

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


def flags(tiny_dir: Path) -> list[str]:
    return [
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
    ]


@dataclass
class Setup:
    cluster: LaunchedCluster
    colo: ServerProcess
    logs: Path

    @property
    def router(self) -> str:
        return self.cluster.url

    @property
    def workers(self) -> list[str]:
        return self.cluster.worker_urls()


@pytest.fixture(scope="module")
def setup(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    logs = tmp_path_factory.mktemp("router")
    with ExitStack() as stack:
        cluster = LaunchedCluster(
            [
                "launch",
                "--prefill",
                "0",
                "--decode",
                "2",
                "--on-worker-exit",
                "continue",
                *flags(tiny_dir),
            ],
            logs / "cluster",
        )
        colo = ServerProcess(["serve", *flags(tiny_dir)], logs / "colo.log")
        for proc in (cluster, colo):  # both start now and load their models side by side
            stack.callback(proc.__exit__)
            proc.start()
        cluster.wait_ready()
        colo.wait_ready()
        yield Setup(cluster, colo, logs)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60)


def finished_counts(workers: list[str]) -> list[float]:
    """Each worker's finished-request counter, from its own /metrics."""
    out = []
    for w in workers:
        text = http("GET", w + "/metrics")[1]
        out.append(
            sum(
                float(ln.split()[-1])
                for ln in text.splitlines()
                if ln.startswith("pdserve_requests_finished_total")
            )
        )
    return out


PROMPTS = ["def main():", "import os", "The quick brown fox", "1, 2, 3,"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def test_answers_equal_the_colocated_server(setup):
    r, c = client(setup.router), client(setup.colo.url)
    for p in PROMPTS:
        kw = dict(model="tiny", prompt=p, max_tokens=12, temperature=0)
        want = c.completions.create(**kw).choices[0]
        got = r.completions.create(**kw).choices[0]
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
        streamed = "".join(
            ch.choices[0].text for ch in r.completions.create(**kw, stream=True) if ch.choices
        )
        assert streamed == want.text
    kw = dict(model="tiny", messages=CHAT, max_tokens=10, temperature=0)
    want_msg = c.chat.completions.create(**kw).choices[0].message.content
    assert r.chat.completions.create(**kw).choices[0].message.content == want_msg
    parts = [
        ch.choices[0].delta.content or ""
        for ch in r.chat.completions.create(**kw, stream=True)
        if ch.choices
    ]
    assert "".join(parts) == want_msg
    assert [m.id for m in r.models.list().data] == ["tiny"]


def test_both_policies_spread_requests_over_both_workers(setup, tiny_dir):
    body = {"model": "tiny", "prompt": "spread", "max_tokens": 2}
    before = finished_counts(setup.workers)
    for _ in range(6):  # the launcher's router: least-outstanding
        assert http("POST", setup.router + "/v1/completions", body)[0] == 200
    mid = finished_counts(setup.workers)
    assert [b - a for a, b in zip(before, mid, strict=True)] == [3, 3]
    rr_args = [
        "router",
        "--decode",
        *setup.workers,
        "--policy",
        "round-robin",
        "--model",
        str(tiny_dir),
    ]
    with ServerProcess(rr_args, setup.logs / "rr-router.log") as rr:
        for _ in range(4):
            status, resp = http("POST", rr.url + "/v1/completions", {**body, "model": None})
            assert status == 200, resp
        after = finished_counts(setup.workers)
        assert [b - a for a, b in zip(mid, after, strict=True)] == [2, 2]
        routed = http("GET", rr.url + "/debug/cluster")[1]["router"]["workers"]
        assert [w["routed"] for w in routed] == [2, 2]
        assert http("GET", rr.url + "/v1/models")[1]["data"][0]["id"] == "tiny"


def metric(url: str, name: str) -> float:
    """The sum of a counter's samples in a worker's /metrics."""
    text = http("GET", url + "/metrics")[1]
    lines = [ln for ln in text.splitlines() if ln.startswith((name + " ", name + "{"))]
    return sum(float(ln.split()[-1]) for ln in lines)


def test_prefix_policy_keeps_a_conversation_on_the_worker_that_caches_it(setup, tiny_dir):
    """`--policy prefix`: the turns of one conversation (each extends the last) land on the
    worker that served its first turn, whose prefix cache then hits; another conversation
    goes to the other worker. The policy's rules are unit-tested in test_prefix_policy.py."""
    args = ["router", "--decode", *setup.workers, "--policy", "prefix", "--model", str(tiny_dir)]
    with ServerProcess(args, setup.logs / "prefix-router.log") as router:

        def send(prompt: str) -> list[float]:
            before = finished_counts(setup.workers)
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
            status, resp = http("POST", router.url + "/v1/completions", body)
            assert status == 200, resp
            return [b - a for a, b in zip(before, finished_counts(setup.workers), strict=True)]

        system = "You are a careful assistant who answers in full sentences. " * 6
        asks = [f"User: question {i} of conversation A. Assistant: an answer. " for i in range(4)]
        turns = [system + "".join(asks[: i + 1]) for i in range(4)]  # each extends the last
        home = send(turns[0]).index(1.0)
        hits = metric(setup.workers[home], "pdserve_prefix_cache_hits_total")
        other = send("An unrelated conversation B begins here, with its own words. " * 4)
        assert other[1 - home] == 1.0  # no expected match anywhere: the other worker in turn
        for prompt in turns[1:]:
            assert send(prompt)[home] == 1.0
        assert metric(setup.workers[home], "pdserve_prefix_cache_hits_total") >= hits + 3
        routed = http("GET", router.url + "/debug/cluster")[1]["router"]
        assert routed["policy"] == "prefix"
        assert routed["policy_stats"]["routed"]["by_prefix"] >= 3


@pytest.mark.parametrize("body,param", BAD)
def test_bad_input_gives_the_same_400_as_the_colocated_server(setup, body, param):
    got = http("POST", setup.router + "/v1/completions", {"model": "tiny", **body})
    want = http("POST", setup.colo.url + "/v1/completions", {"model": "tiny", **body})
    assert got == want and got[0] == 400 and got[1]["error"]["param"] == param


def test_malformed_and_unknown_model_match_too(setup):
    for path, kw in [
        ("/v1/completions", {"raw": b"{not json"}),
        ("/v1/completions", {"body": {"model": "gpt-9", "prompt": "x"}}),
        ("/v1/chat/completions", {"body": {"messages": "hi"}}),
    ]:
        got = http("POST", setup.router + path, **kw)
        assert got == http("POST", setup.colo.url + path, **kw) and got[0] in (400, 404)


def test_deep_health_passes_through_every_worker(setup):
    status, body = http("GET", setup.router + "/health/deep")
    assert status == 200 and body["ok"], body
    assert sorted(p["decode"] for p in body["pairs"]) == sorted(setup.workers)
    assert all(p["prefill"] is None and p["latency_ms"] > 0 for p in body["pairs"])
    assert http("GET", setup.router + "/health")[0] == 200


def test_debug_cluster_has_every_workers_state(setup):
    status, doc = http("GET", setup.router + "/debug/cluster")
    assert status == 200
    assert sorted(doc["workers"]) == sorted(setup.workers)
    for w in doc["workers"].values():
        assert w["role"] == "decode" and "engine" in w["state"], w
    pids = {w["url"]: w["pid"] for w in doc["router"]["workers"]}
    assert pids == {p["url"]: p["pid"] for n, p in setup.cluster.processes.items() if n != "router"}
    assert doc["router"]["pid"] == setup.cluster.processes["router"]["pid"]


def live_requests(workers: list[str]) -> int:
    return sum(len(http("GET", w + "/debug/state")[1]["engine"]["requests"]) for w in workers)


def test_client_disconnect_aborts_on_the_worker(setup):
    u = urlparse(setup.router)
    conn = httpclient.HTTPConnection(u.hostname, u.port, timeout=30)
    body = {
        "model": "tiny",
        "prompt": "abc " * 20,
        "max_tokens": 800,
        "stream": True,
        "ignore_eos": True,
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(3):
        assert resp.readline().startswith(b"data: ")
        resp.readline()
    assert live_requests(setup.workers) == 1
    t0 = time.monotonic()
    conn.sock.close()
    conn.close()
    while live_requests(setup.workers):
        # 800 tokens take several seconds here; only an abort ends it within the bound.
        assert time.monotonic() - t0 < 2.0, "the worker still runs the request"
        time.sleep(0.01)
    metrics = http("GET", setup.router + "/metrics")[1]
    assert 'pdserve_router_requests_total{outcome="aborted"} 1.0' in metrics
    for name in (
        "pdserve_router_worker_outstanding",
        "pdserve_router_worker_healthy",
        "pdserve_router_deep_health_ok",
        "pdserve_router_time_to_first_token_seconds",
    ):
        assert name in metrics


def test_killed_worker_leaves_rotation_and_the_other_serves(setup):
    """Destructive: runs last in this module."""
    victim, survivor = setup.workers[1], setup.workers[0]
    pid = next(p["pid"] for p in setup.cluster.processes.values() if p["url"] == victim)
    os.kill(pid, signal.SIGKILL)
    assert wait_gone([pid], 10.0) == []
    t_end = time.monotonic() + 5.0  # an answer from before the kill is at most 1 s old
    while (reply := http("GET", setup.router + "/health/deep"))[0] == 200:
        assert reply[1]["age_s"] is not None and time.monotonic() < t_end, reply
        time.sleep(0.1)
    status, body = reply
    assert status == 503 and not body["ok"]
    by_worker = {p["decode"]: p for p in body["pairs"]}
    assert by_worker[survivor]["ok"] and not by_worker[victim]["ok"]
    assert victim in by_worker[victim]["error"]
    doc = http("GET", setup.router + "/debug/cluster")[1]
    rotation = {w["url"]: w["in_rotation"] for w in doc["router"]["workers"]}
    assert rotation == {survivor: True, victim: False}
    assert "error" in doc["workers"][victim] and "state" in doc["workers"][survivor]
    before = finished_counts([survivor])[0]
    r = client(setup.router)
    for p in PROMPTS:  # served (its text may be empty: random bytes, an unfinished character)
        out = r.completions.create(model="tiny", prompt=p, max_tokens=3)
        assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens
    assert finished_counts([survivor])[0] - before == len(PROMPTS)
    assert http("GET", setup.router + "/health")[0] == 200  # the router itself is fine


def test_router_refuses_to_start_without_its_workers(tiny_dir):
    dead = "http://127.0.0.1:9"  # discard port: nothing answers
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve",
            "router",
            "--decode",
            dead,
            "--model",
            str(tiny_dir),
            "--port",
            "0",
            "--startup-timeout",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 2, out
    assert f"worker {dead} did not answer GET /info within 1s" in out and "READY" not in out
