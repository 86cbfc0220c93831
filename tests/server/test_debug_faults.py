"""/debug/faults on a real prefill worker: refused without --debug-faults, validated, and a
point set over HTTP acts on the worker's control plane at once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from pdserve.protocol.messages import Ping, Pong, decode, encode
from pdserve.runtime.cluster_key import ClusterKey
from pdserve.runtime.launcher import LaunchConfig, worker_argvs
from pdserve.transfer.frame_auth import FrameAuth
from tests.helpers import join_as_member
from tests.procs import ServerProcess, http, worker_args


@pytest.fixture(scope="module")
def workers(tiny_dir, tmp_path_factory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """(without --debug-faults, with it), started together."""
    logs = tmp_path_factory.mktemp("debug-faults")
    args = ["serve", "--role", "prefill", *worker_args(tiny_dir, kv_mb=8)]
    off = ServerProcess(args, logs / "off.log")
    on = ServerProcess([*args, "--debug-faults"], logs / "on.log")
    off.start()
    on.start()
    try:
        yield off.wait_ready(), on.wait_ready()
    finally:
        off.stop()
        on.stop()


def ping(control: str, nonce: int, timeout_ms: int = 1000) -> bool:
    """True if the worker at `control` answers a Ping within the timeout."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IDENTITY, f"pinger-{nonce}".encode())  # P answers by identity
    key = ClusterKey.from_env(None)
    assert key is not None  # tests/conftest.py gives the run a key
    join_as_member(s, key)
    s.connect(control)
    auth = FrameAuth(key, f"pinger-{nonce}")
    try:
        s.send_multipart(auth.sign([encode(Ping(nonce=nonce))]))
        if not s.poll(timeout_ms):
            return False
        parts = s.recv_multipart()
        assert auth.check(None, parts) is None  # P signs its answers too
        reply = decode(parts[1])
        return isinstance(reply, Pong) and reply.nonce == nonce
    finally:
        s.close(0)


@pytest.mark.process
def test_post_is_refused_without_the_flag(workers):
    off, _ = workers
    status, body = http("POST", off.url + "/debug/faults", {"spec": "p.write=raise", "seed": 0})
    assert status == 403
    assert body["error"]["type"] == "invalid_request_error"
    assert (
        body["error"]["code"] == "debug_faults_off" and "--debug-faults" in body["error"]["message"]
    )
    assert http("GET", off.url + "/debug/faults") == (200, {"points": {}, "seed": 0, "fired": {}})


@pytest.mark.process
def test_bad_requests_get_400_and_change_nothing(workers):
    _, on = workers
    status, body = http("POST", on.url + "/debug/faults", {"spec": "p.write=explode", "seed": 0})
    assert status == 400 and body["error"]["code"] == "bad_fault_spec"
    assert "'p.write=explode'" in body["error"]["message"] and body["error"]["param"] == "spec"
    for bad in ({"spec": 3}, {"spec": "", "seed": "x"}, ["p.write=raise"]):
        status, body = http("POST", on.url + "/debug/faults", bad)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", bad
    status, body = http("POST", on.url + "/debug/faults", raw=b"{")
    assert status == 400 and body["error"]["code"] == "bad_json"
    assert http("GET", on.url + "/debug/faults")[1]["points"] == {}


@pytest.mark.process
def test_a_point_set_over_http_acts_at_once_and_clears(workers):
    _, on = workers
    control = http("GET", on.url + "/info")[1]["control"]
    assert ping(control, 1)
    status, snap = http(
        "POST", on.url + "/debug/faults", {"spec": "control.recv.Ping=drop", "seed": 5}
    )
    assert status == 200 and snap == {
        "points": {"control.recv.Ping": "drop@1"},
        "seed": 5,
        "fired": {},
    }
    assert not ping(control, 2, timeout_ms=500)
    assert http("GET", on.url + "/debug/faults")[1]["fired"] == {"control.recv.Ping": 1}
    assert http("POST", on.url + "/debug/faults", {"spec": ""})[0] == 200
    assert ping(control, 3)
    assert http("GET", on.url + "/health")[0] == 200


def test_launch_passes_debug_faults_to_every_worker():
    def argvs(debug_faults: bool) -> list[list[str]]:
        cfg = LaunchConfig(
            model_path="/m",
            served_model_name="tiny",
            prefill=1,
            decode=2,
            threads=1,
            engine_flags=(),
            log_dir=Path("/tmp/x"),
            cluster_key_file="/tmp/x/cluster.key",
            debug_faults=debug_faults,
        )
        return [argv for _, argv in worker_argvs(cfg)]

    assert all("--debug-faults" in argv for argv in argvs(True))
    assert not any("--debug-faults" in argv for argv in argvs(False))
