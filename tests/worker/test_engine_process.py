"""The engine in a process of its own (`serve --engine-process`): worker/host/process.py,
worker/host/client.py and their frames (worker/host/frames.py)."""

from __future__ import annotations

import http.client as httpclient
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import msgspec
import pytest

from pdserve.protocol.outputs import RequestOutput, TokenLogprob
from pdserve.protocol.sampling import SamplingParams
from pdserve.runtime.pids import signal_pdserve, wait_gone
from pdserve.runtime.timing import ENGINE_STATUS_STALE_S
from pdserve.worker.host import frames as f
from pdserve.worker.host import process as engine_process
from tests.helpers import hf_greedy
from tests.procs import LaunchedCluster, ServerProcess, http, wait_stopped, worker_args

PROMPTS = [[5, 9, 14, 2, 33], [7, 7, 7], [100, 200, 300, 400, 500, 600, 700, 800, 900]]
NEW = 12

SAMPLES: list[f.Frame] = [
    f.Submit("r1", [1, 2, 3], SamplingParams(max_tokens=4, seed=7), 5.0, "tcp://127.0.0.1:9"),
    f.AbortRequest("r1"),
    f.Query(3, "state", 2.0),
    f.SetFaults(4, "p.write=delay:1", 1),
    f.Stop(),
    f.Outputs(
        [
            RequestOutput("r1", (4,), (TokenLogprob(4, -0.5, ((4, -0.5), (9, -1.0))),)),
            RequestOutput("r2", (), (), "error", "why"),
        ]
    ),
    f.Status(["a problem"], True),
    f.Reply(3, {"engine": {"steps": 1}, "threads": []}),
    f.Reply(4, None, "bad spec"),
    f.Fatal("engine died"),
    f.Stopped(["engine"]),
    f.Stopped(None),
]


def test_frames_arrive_whole_however_the_stream_is_cut() -> None:
    down = [
        s
        for s in SAMPLES
        if isinstance(s, f.Submit | f.AbortRequest | f.Query | f.SetFaults | f.Stop)
    ]
    up = [s for s in SAMPLES if s not in down]
    for frames, is_up in ((down, False), (up, True)):
        stream = b"".join(f.encode(s) for s in frames)
        for cut in (1, 3, 7, len(stream)):
            reader = f.Frames(up=is_up)
            got = []
            for i in range(0, len(stream), cut):
                got += reader.feed(stream[i : i + cut])
            assert got == frames


def test_bytes_that_are_no_frame_become_garbled_values_not_exceptions() -> None:
    body = b"\x93\xa3abc"  # msgpack, but no frame of either direction
    got = f.Frames(up=True).feed(f.HEADER.pack(len(body)) + body)
    assert len(got) == 1 and isinstance(got[0], f.Garbled)
    # A down frame read as an up one is garbled too: the two unions share no tag.
    assert isinstance(f.Frames(up=True).feed(f.encode(f.AbortRequest("x")))[0], f.Garbled)
    huge = f.Frames(up=False).feed(f.HEADER.pack(f.MAX_FRAME + 1) + b"x" * 16)
    assert len(huge) == 1 and "at most" in huge[0].why
    # A Submit whose params break their own rules is refused as they would be over HTTP.
    bad = msgspec.msgpack.encode(["Submit", "r", [1], {"max_tokens": -5}, None, None])
    got = f.Frames(up=False).feed(f.HEADER.pack(len(bad)) + bad)
    assert isinstance(got[0], f.Garbled) and "max_tokens" in got[0].why


def _read_up(sock: socket.socket) -> list[object]:
    sock.settimeout(5.0)
    frames, got = f.Frames(up=True), []
    while True:
        try:
            data = sock.recv(1 << 20)
        except TimeoutError:
            return got
        if not data:
            return got
        got += frames.feed(data)


def test_a_tick_of_large_outputs_goes_up_in_frames_that_fit(monkeypatch) -> None:
    monkeypatch.setattr(engine_process, "OUTPUTS_FRAME_BYTES", 300)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        up = engine_process.Uplink(ours)
        outs = [RequestOutput(f"r{i}", tuple(range(20))) for i in range(9)]
        for out in outs:
            up.collect(out)
        up.flush()
        ours.shutdown(socket.SHUT_WR)
        frames = _read_up(theirs)
    assert len(frames) > 1 and all(isinstance(fr, f.Outputs) for fr in frames)
    assert [o for fr in frames for o in fr.outputs] == outs  # all of them, in order


def test_a_failed_send_takes_the_link_down_for_good() -> None:
    """Part of a frame may be on the socket: nothing after it could be read. The worker must
    see the end (its fatal error), and nothing more is sent."""
    ours, theirs = socket.socketpair()
    with ours:
        ours.settimeout(0.2)
        up = engine_process.Uplink(ours)
        with theirs:  # the worker reads nothing: the send times out part way
            with pytest.raises(OSError):
                up.send(f.Outputs([RequestOutput("r", tuple(range(10**6)))]))
            assert up.broken is not None
            with pytest.raises(ConnectionError):
                up.send(f.Status([], False))
            theirs.settimeout(5.0)
            while theirs.recv(1 << 20):  # what was written, then the end
                pass


def _engine_pid(srv: ServerProcess) -> int:
    status, info = http("GET", srv.url + "/info")
    assert status == 200 and info["engine_pid"] != info["pid"] == srv.pid
    return int(info["engine_pid"])


def _serve(tiny_dir: Path, log: Path, *extra: str) -> ServerProcess:
    args = ["serve", *worker_args(tiny_dir), "--served-model-name", "tiny", "--engine-process"]
    return ServerProcess([*args, *extra], log)


def _kill_engine(pid: int | None) -> None:
    """The engine process by pid, if a failed test left it (it dies with its worker anyway)."""
    if pid is not None and signal_pdserve(pid, signal.SIGKILL):
        wait_gone([pid], 10.0)


@pytest.fixture(scope="module")
def split(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = _serve(tiny_dir, tmp_path_factory.mktemp("logs") / "split.log", "--debug-faults")
    pid = None
    with srv:
        pid = _engine_pid(srv)
        yield srv
    _kill_engine(pid)


def _complete(url: str, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0}
    status, out = http("POST", url + "/v1/completions", body)
    assert status == 200, out
    return out


def _generate(url: str, rid: str, prompt: list[int], prefill: str | None = None) -> list[int]:
    """A worker's own /generate, greedy, EOS ignored: the generated ids."""
    params = {"max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    body = {"request_id": rid, "prompt_ids": prompt, "params": params}
    if prefill is not None:
        body["prefill"] = prefill
    status, text = http("POST", url + "/generate", body)
    assert status == 200, text
    lines = (
        [json.loads(line) for line in text.splitlines() if line.strip()]
        if isinstance(text, str)
        else [text]
    )
    assert lines[-1]["finish_reason"] == "length", lines[-1]
    return [t for line in lines for t in line["token_ids"]]


@pytest.mark.process
def test_greedy_through_the_engine_process_is_hf_greedy(split: ServerProcess, tiny_dir) -> None:
    want = hf_greedy(tiny_dir, PROMPTS, NEW)
    got: dict[int, list[int]] = {}

    def one(i: int) -> None:  # all at once: they share the engine's batches
        got[i] = _generate(split.url, f"parity-{i}", PROMPTS[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got.get(i) for i in range(len(PROMPTS))] == want


@pytest.mark.process
def test_health_state_metrics_and_faults_come_from_the_engine_process(split) -> None:
    assert http("GET", split.url + "/health") == (200, {"status": "ok", "problems": []})
    _complete(split.url, PROMPTS[0])
    status, state = http("GET", split.url + "/debug/state")
    assert status == 200 and state["engine"]["steps"] > 0
    assert [t["name"] for t in state["threads"]] == ["engine"]  # the engine process's thread
    status, metrics = http("GET", split.url + "/metrics")
    assert status == 200 and "pdserve_generation_tokens_total" in metrics
    spec = {"spec": "p.write=delay:0.5", "seed": 3}
    status, faults = http("POST", split.url + "/debug/faults", spec)
    assert status == 200 and list(faults["points"]) == ["p.write"] and faults["seed"] == 3
    assert http("GET", split.url + "/debug/faults")[1] == faults
    status, err = http("POST", split.url + "/debug/faults", {"spec": "nowhere=explode"})
    assert status == 400 and err["error"]["code"] == "bad_fault_spec"
    assert http("POST", split.url + "/debug/faults", {"spec": ""})[1]["points"] == {}
    assert http("GET", split.url + "/debug/invariants")[1]["ok"] is True


@pytest.mark.process
def test_a_client_gone_mid_stream_ends_its_request_in_the_engine(split) -> None:
    u = urlparse(split.url)
    conn = httpclient.HTTPConnection(u.hostname, u.port, timeout=30)
    body = {"model": "tiny", "prompt": "abc " * 20, "max_tokens": 800, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps({**body, "ignore_eos": True}))
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(3):
        assert resp.readline().startswith(b"data: ")
        resp.readline()
    assert http("GET", split.url + "/debug/state")[1]["engine"]["requests"]
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 20
    while http("GET", split.url + "/debug/state")[1]["engine"]["requests"]:
        assert time.monotonic() < deadline, "the request outlived its client"
        time.sleep(0.1)
    assert http("GET", split.url + "/debug/invariants")[1]["ok"] is True


@pytest.mark.process
def test_a_stopped_engine_process_turns_health_red_and_back(split) -> None:
    """SIGSTOP: no Status comes, and /health says so once ENGINE_STATUS_STALE_S passed; the debug
    endpoints answer within their own bound meanwhile. SIGCONT: green again."""
    pid = _engine_pid(split)
    assert signal_pdserve(pid, signal.SIGSTOP)
    try:
        wait_stopped(pid)  # stopped for sure before the queries
        t0 = time.monotonic()
        status, state = http("GET", split.url + "/debug/state", timeout=10)
        assert status == 200 and "did not answer" in state["engine"]["error"]
        assert time.monotonic() - t0 < ENGINE_STATUS_STALE_S  # its 2 s bound, not a hang
        deadline = time.monotonic() + ENGINE_STATUS_STALE_S + 10
        while (health := http("GET", split.url + "/health"))[0] == 200:
            assert time.monotonic() < deadline, "health stayed green"
            time.sleep(0.2)
        assert health[0] == 503 and "has not reported" in health[1]["problems"][0]
    finally:
        signal_pdserve(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while http("GET", split.url + "/health")[0] != 200:
        assert time.monotonic() < deadline, "health did not come back"
        time.sleep(0.1)
    assert _complete(split.url, PROMPTS[2])["choices"][0]["finish_reason"] == "length"


@pytest.mark.process
def test_sigterm_stops_the_worker_and_its_engine_process_cleanly(tiny_dir, tmp_path) -> None:
    pid = None
    try:
        with _serve(tiny_dir, tmp_path / "s.log") as srv:
            pid = _engine_pid(srv)
            _complete(srv.url, PROMPTS[1])
            assert srv.stop() == 0, srv.log()[-2000:]
        assert wait_gone([pid], 10.0) == []
    finally:
        _kill_engine(pid)


@pytest.mark.process
@pytest.mark.parametrize("how", ["SIGKILL", "its engine thread dead"])
def test_the_engine_process_dying_is_the_workers_fatal_error(how, tiny_dir, tmp_path) -> None:
    """Killed, or its engine thread dead for good (a `kill:0` fault: the engine process's
    supervisor sends Fatal): the running request ends with an error and the worker exits 1."""
    pid = None
    try:
        with _serve(tiny_dir, tmp_path / "s.log", "--debug-faults") as srv:
            pid = _engine_pid(srv)
            ended: list[dict] = []

            def long_request() -> None:  # running when the engine process dies
                ended.append(_request_ending(srv.url))

            t = threading.Thread(target=long_request)
            t.start()
            deadline = time.monotonic() + 20
            while not http("GET", srv.url + "/debug/state")[1]["engine"]["requests"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            if how == "SIGKILL":
                assert signal_pdserve(pid, signal.SIGKILL)
            else:
                spec = {"spec": "thread.engine=kill:0"}
                assert http("POST", srv.url + "/debug/faults", spec)[0] == 200
            t.join(30)
            assert srv.proc is not None
            assert srv.proc.wait(30) == 1
        assert ended and ended[0]["finish_reason"] == "error", ended
        said = "the engine process failed" if how == "SIGKILL" else "thread engine dead"
        assert said in srv.log()
        assert wait_gone([pid], 10.0) == []
    finally:
        _kill_engine(pid)


def _request_ending(url: str) -> dict:
    """The last choice of a long streamed completion (its finish_reason, and error if any)."""
    u = urlparse(url)
    conn = httpclient.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {"model": "tiny", "prompt": "abc " * 20, "max_tokens": 900, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps({**body, "ignore_eos": True}))
    last: dict = {}
    for raw in conn.getresponse():
        line = raw.decode().strip()
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            if "error" in event:
                return {"finish_reason": "error", "error": event["error"]}
            if event["choices"]:
                last = event["choices"][0]
    conn.close()
    return last


@pytest.mark.process
def test_the_engine_process_dies_with_its_worker(tiny_dir, tmp_path) -> None:
    pid = None
    try:
        with _serve(tiny_dir, tmp_path / "s.log") as srv:
            pid = _engine_pid(srv)
            assert srv.proc is not None
            srv.proc.kill()
            srv.proc.wait(10)
            assert wait_gone([pid], 10.0) == []
    finally:
        _kill_engine(pid)


@pytest.mark.process
@pytest.mark.parametrize("backend", ["shm", "nixl"])
def test_a_decode_worker_with_an_engine_process_serves_pd_greedy(
    tiny_dir, tmp_path, backend: str
) -> None:
    """1P+1D, both with engine processes: P writes into the D engine process's pool, which
    that process mapped (shm) or registered with its NIXL agent (nixl, CUDA's default plane)."""
    want = hf_greedy(tiny_dir, PROMPTS, NEW)
    args = ["launch", "--prefill", "1", "--decode", "1", "--engine-process"]
    args += [*worker_args(tiny_dir, backend), "--served-model-name", "tiny"]
    with LaunchedCluster(args, tmp_path / "logs") as cluster:
        infos = {i["role"]: i for i in (http("GET", u + "/info")[1] for u in cluster.worker_urls())}
        d_url = cluster.processes["decode-0"]["url"]
        prefill = infos["prefill"]["control"]
        got = [_generate(d_url, f"pd-{i}", p, prefill) for i, p in enumerate(PROMPTS)]
        assert _complete(cluster.url, PROMPTS[0])["choices"][0]["finish_reason"] == "length"
        # The roles' metrics live in the engine processes' registries: /metrics shows them.
        remote = f'pdserve_pd_requests_total{{prefill="remote"}} {len(PROMPTS) + 1}.0'
        assert remote in http("GET", d_url + "/metrics")[1]
        p_url = cluster.processes["prefill-0"]["url"]
        done = f'pdserve_pd_exports_total{{outcome="done"}} {len(PROMPTS) + 1}.0'
        assert done in http("GET", p_url + "/metrics")[1]
        engines = [i["engine_pid"] for i in infos.values()]
    assert got == want
    assert wait_gone(engines, 10.0) == []
