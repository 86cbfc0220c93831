"""Abort from each state of a room, with fault points holding the room in that state.

P stalls before each KV write (so a room sits mid-write); D stalls between PrefillDone and
joining the decode batch. After every abort: both workers quiet (no request, no room, every
page free), every thread alive, and the next request succeeds.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest

from tests.pd.conftest import CHUNK, PD, tokens
from tests.procs import ServerProcess, auth_headers, worker_args
from tests.procs import http as call

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

STALL_S = 1.5


# shm and nixl: tcp runs the same room logic as shm with the bytes on another route, while
# nixl's WRITEs complete asynchronously and D learns of them by notification.
@pytest.fixture(scope="module", params=["shm", "nixl"])
def faulty(request, tiny_dir, tmp_path_factory) -> Iterator[PD]:
    backend = request.param
    logs = tmp_path_factory.mktemp(f"pd-faults-{backend}")
    common = worker_args(tiny_dir, backend, CHUNK)
    p = ServerProcess(
        ["serve", "--role", "prefill", *common],
        logs / "p.log",
        env={"PDSERVE_FAULTS": f"p.write=delay:{STALL_S}"},
    ).__enter__()
    try:
        d = ServerProcess(
            ["serve", "--role", "decode", *common],
            logs / "d.log",
            env={"PDSERVE_FAULTS": f"d.start_decode=delay:{STALL_S}"},
        ).__enter__()
    except BaseException:
        p.stop()
        raise
    try:
        yield PD(p, d, call("GET", p.url + "/info")[1]["control"], backend)
    finally:
        d.stop()
        p.stop()


def start(pd: PD, rid: str, prompt: list[int], max_tokens: int = 200) -> http.client.HTTPConnection:
    u = urlparse(pd.d.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {
        "request_id": rid,
        "prompt_ids": prompt,
        "prefill": pd.control,
        "params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    }
    conn.request("POST", "/generate", json.dumps(body), auth_headers())
    threading.Thread(target=lambda: conn.getresponse(), daemon=True).start()
    return conn


def disconnect(conn: http.client.HTTPConnection) -> None:
    conn.sock.shutdown(2)
    conn.close()


def p_state(pd: PD) -> dict:
    return call("GET", pd.p.url + "/debug/state", timeout=10)[1]["engine"]["role"]


def wait_for(pred, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (value := pred()):
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)
    return value


def check_recovered(pd: PD) -> None:
    pd.wait_quiet(timeout_s=30)
    for url in (pd.p.url, pd.d.url):
        state = call("GET", url + "/debug/state", timeout=10)[1]
        assert all(t["alive"] and t["crashes"] == 0 for t in state["threads"]), state["threads"]
    assert len(tokens(pd.generate(f"next-{time.monotonic_ns()}", [3, 4, 5], max_tokens=2))) == 2


def test_abort_mid_write_on_prefill_side(faulty):
    prompt = list(range(7, 7 + 3 * CHUNK + 5))  # four chunks: P stalls before each write
    conn = start(faulty, "midwrite", prompt)
    rooms = wait_for(lambda: p_state(faulty)["rooms"])
    assert rooms[0]["state"] == "prefilling"
    disconnect(conn)
    wait_for(lambda: p_state(faulty)["stats"]["aborted"] >= 1)
    check_recovered(faulty)


def test_abort_after_prefill_done_before_decoding(faulty):
    before = p_state(faulty)["stats"]["done"]
    conn = start(faulty, "donegap", list(range(20, 30)))  # one chunk: one stalled write
    wait_for(lambda: p_state(faulty)["stats"]["done"] > before)  # D now stalls in start_decode
    disconnect(conn)
    check_recovered(faulty)


def test_abort_while_decoding(faulty):
    # Past the write stall and the start-decode stall, until D decodes it: polled, not slept
    # (200 tokens of the tiny model took under half a second once the stalls were over, so a
    # fixed sleep could find it done). Long enough to be still decoding when the client goes.
    conn = start(faulty, "decoding", [9, 8, 7], max_tokens=900)

    def decoding() -> list[dict]:
        # The snapshot may time out while D's engine sits in its start-decode stall: retry.
        engine = call("GET", faulty.d.url + "/debug/state", timeout=10)[1]["engine"]
        reqs = engine.get("requests", [])
        return [r for r in reqs if r["state"] == "running" and r["output_tokens"] > 0]

    assert [r["request_id"] for r in wait_for(decoding)] == ["decoding"]
    disconnect(conn)
    check_recovered(faulty)
