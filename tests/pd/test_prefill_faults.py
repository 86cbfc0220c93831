"""A prefill worker that is slow, that fails a write, or whose engine is stuck.

* A long prefill step is slowness, not death. D declares a P dead after PEER_TIMEOUT_S (5 s)
  without a Pong while it has rooms open, but P's engine may spend longer in one step (a big
  prompt chunk on a CPU; its own heartbeat bound is 30 s), so P answers Pings on its control
  thread and reports how long its engine has been in the current tick.
* A stuck engine is still found out: D ignores Pongs that report one (a fake P here).
* A KV write that fails, on a prompt's last chunk or on an earlier one, fails that request
  only. When the last chunk's write fails, the room fails in the same step that samples the
  prompt's first token: that token must be dropped, not handed to a request that already left
  the batch (it used to raise in the engine thread, which the supervisor then restarted).

One P (with --debug-faults: each test sets its fault points at run time) and one D for all.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from pdserve.protocol import messages as m
from pdserve.runtime.timing import PEER_ENGINE_STALL_S, PEER_TIMEOUT_S
from tests.pd.conftest import CHUNK, PD, KeyedSocket, tokens
from tests.procs import ServerProcess, http, worker_args

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


@pytest.fixture(scope="module")
def pd(tiny_dir, tmp_path_factory) -> Iterator[PD]:
    logs = tmp_path_factory.mktemp("prefill-faults")
    common = worker_args(tiny_dir, "shm", CHUNK)
    p_args = ["serve", "--role", "prefill", *common, "--debug-faults"]
    with (
        ServerProcess(p_args, logs / "p.log") as p,
        ServerProcess(["serve", "--role", "decode", *common], logs / "d.log") as d,
    ):
        yield PD(p, d, http("GET", p.url + "/info")[1]["control"], "shm")


def set_faults(pd: PD, spec: str) -> None:
    status, body = http("POST", pd.p.url + "/debug/faults", {"spec": spec, "seed": 0})
    assert status == 200, body


def no_crashes(pd: PD) -> None:
    for w in (pd.p, pd.d):
        threads = http("GET", w.url + "/debug/state")[1]["threads"]
        assert all(t["alive"] and t["crashes"] == 0 for t in threads), threads


def test_a_step_longer_than_the_silence_bound_is_not_death(pd):
    prompt = list(range(3, 90))
    fast = tokens(pd.generate("fast", prompt, max_tokens=6))
    failed_before = http("GET", pd.d.url + "/debug/state")[1]["engine"]["role"]["stats"]["failed"]
    # P's engine sleeps inside its tick, once, past D's silence bound.
    set_faults(pd, f"p.write=delay:{PEER_TIMEOUT_S + 2.5}#1")
    t0 = time.monotonic()
    slow = tokens(pd.generate("slow", prompt, max_tokens=6))
    assert time.monotonic() - t0 > PEER_TIMEOUT_S  # the stall happened, and was outlived
    assert slow == fast
    role = http("GET", pd.d.url + "/debug/state")[1]["engine"]["role"]
    assert role["stats"]["failed"] == failed_before, role["stats"]
    no_crashes(pd)
    pd.wait_quiet()


def test_a_failed_write_fails_only_its_request(pd):
    set_faults(pd, "p.write=raise#2")  # the next two writes P attempts raise
    # One chunk: its only write is the last chunk's. Three chunks: the first write fails.
    for rid, n in (("last-chunk", CHUNK // 2), ("first-of-3", CHUNK * 3)):
        prompt = [7 + i % 100 for i in range(n)]
        last = pd.generate(rid, prompt, max_tokens=4)[-1]
        assert last["finish_reason"] == "error" and "KV write failed" in last["error"], last
    assert tokens(pd.generate("works", prompt, max_tokens=4))
    no_crashes(pd)
    pd.wait_quiet()


def test_pongs_from_a_stalled_prefill_engine_do_not_keep_it_alive(pd):
    """A fake P registers D, accepts the room, then answers every Ping with a Pong saying its
    engine has been stuck for an hour: D must declare it dead as if it were silent."""
    d = pd.d
    fake = KeyedSocket(zmq.ROUTER, "fake-prefill")
    address = f"tcp://127.0.0.1:{fake.sock.bind_to_random_port('tcp://127.0.0.1')}"
    result: dict[str, object] = {}

    def client() -> None:
        body = {
            "request_id": "stalled-p",
            "prompt_ids": [1, 2, 3, 4],
            "prefill": address,
            "params": {"max_tokens": 4, "temperature": 0},
        }
        result["answer"] = http("POST", d.url + "/generate", body, timeout=60)

    stalled_before = (
        http("GET", d.url + "/debug/state")[1]["engine"]["role"]["stats"]["stale"]
    ).get("pong_engine_stalled", 0)
    t = threading.Thread(target=client, daemon=True)
    t.start()
    accepted_at = None
    try:
        deadline = time.monotonic() + 40
        while t.is_alive() and time.monotonic() < deadline:
            if not fake.sock.poll(100):
                continue
            ident, frames = fake.recv()
            msg = m.decode(frames[0])
            if isinstance(msg, m.Hello):
                reply: m.Msg = m.HelloAck(nonce=msg.nonce, address=address)
            elif isinstance(msg, m.Register):
                reply = m.RegisterAck(ok=True, layout=msg.layout)
            elif isinstance(msg, m.PrefillRequest):
                reply = m.PrefillAccept(room=msg.room, epoch=msg.epoch)
                accepted_at = time.monotonic()
            elif isinstance(msg, m.Ping):
                reply = m.Pong(nonce=msg.nonce, engine_busy_s=PEER_ENGINE_STALL_S + 3600)
            else:
                continue
            fake.send(m.encode(reply), to=ident)
        t.join(5)
    finally:
        fake.close()
    assert accepted_at is not None, "D never sent its PrefillRequest"
    status, text = result["answer"]  # type: ignore[misc]
    assert status == 200
    last = text if isinstance(text, dict) else json.loads(text.strip().splitlines()[-1])
    assert last["finish_reason"] == "error" and "died" in last["error"], last
    role = http("GET", d.url + "/debug/state")[1]["engine"]["role"]
    assert role["stats"]["stale"].get("pong_engine_stalled", 0) >= stalled_before + 3, role["stats"]
    assert http("GET", d.url + "/health")[0] == 200
    no_crashes(pd)
