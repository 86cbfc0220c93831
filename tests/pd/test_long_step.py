"""A long prefill step is slowness, not death; a stalled prefill engine is still found out.

D declares a P dead after PEER_TIMEOUT_S (5 s) without a Pong while it has rooms open. P's
engine may legitimately spend longer than that in one step (a big prompt chunk on a CPU; its
own heartbeat bound is 30 s), so P answers Pings on its control thread and reports how long
its engine has been in the current tick; D ignores Pongs that report a stalled engine.
"""

from __future__ import annotations

import json
import threading
import time

import zmq

from pdserve.protocol import messages as m
from pdserve.worker.decode import PEER_ENGINE_STALL_S, PEER_TIMEOUT_S
from tests.pd.conftest import CHUNK, PD, tokens
from tests.procs import ServerProcess, http, worker_args


def test_a_step_longer_than_the_silence_bound_is_not_death(tiny_dir, tmp_path):
    common = worker_args(tiny_dir, "shm", CHUNK)
    # P's engine sleeps inside its tick, once, past D's silence bound.
    stall = {"PDSERVE_FAULTS": f"p.write=delay:{PEER_TIMEOUT_S + 2.5}#1"}
    with (
        ServerProcess(["serve", "--role", "prefill", *common], tmp_path / "p.log", env=stall) as p,
        ServerProcess(["serve", "--role", "decode", *common], tmp_path / "d.log") as d,
    ):
        pd = PD(p, d, http("GET", p.url + "/info")[1]["control"], "shm")
        prompt = list(range(3, 90))
        t0 = time.monotonic()
        slow = tokens(pd.generate("slow", prompt, max_tokens=6))
        assert time.monotonic() - t0 > PEER_TIMEOUT_S  # the stall happened, and was outlived
        assert tokens(pd.generate("fast", prompt, max_tokens=6)) == slow
        role = http("GET", d.url + "/debug/state")[1]["engine"]["role"]
        assert role["stats"]["failed"] == 0, role["stats"]
        pd.wait_quiet()


def test_pongs_from_a_stalled_prefill_engine_do_not_keep_it_alive(tiny_dir, tmp_path):
    """A fake P registers D, accepts the room, then answers every Ping with a Pong saying its
    engine has been stuck for an hour: D must declare it dead as if it were silent."""
    common = worker_args(tiny_dir, "shm", CHUNK)
    with ServerProcess(["serve", "--role", "decode", *common], tmp_path / "d.log") as d:
        fake = zmq.Context.instance().socket(zmq.ROUTER)
        fake.setsockopt(zmq.LINGER, 0)
        address = f"tcp://127.0.0.1:{fake.bind_to_random_port('tcp://127.0.0.1')}"
        result: dict[str, object] = {}

        def client() -> None:
            body = {
                "request_id": "stalled-p",
                "prompt_ids": [1, 2, 3, 4],
                "prefill": address,
                "params": {"max_tokens": 4, "temperature": 0},
            }
            result["answer"] = http("POST", d.url + "/generate", body, timeout=60)

        t = threading.Thread(target=client, daemon=True)
        t.start()
        accepted_at = None
        try:
            deadline = time.monotonic() + 40
            while t.is_alive() and time.monotonic() < deadline:
                if not fake.poll(100):
                    continue
                ident, frame = fake.recv_multipart()[:2]
                msg = m.decode(frame)
                if isinstance(msg, m.Register):
                    reply: m.Msg = m.RegisterAck(ok=True, layout=msg.layout)
                elif isinstance(msg, m.PrefillRequest):
                    reply = m.PrefillAccept(room=msg.room, epoch=msg.epoch)
                    accepted_at = time.monotonic()
                elif isinstance(msg, m.Ping):
                    reply = m.Pong(nonce=msg.nonce, engine_busy_s=PEER_ENGINE_STALL_S + 3600)
                else:
                    continue
                fake.send_multipart([ident, m.encode(reply)])
            t.join(5)
        finally:
            fake.close(0)
        assert accepted_at is not None, "D never sent its PrefillRequest"
        status, text = result["answer"]  # type: ignore[misc]
        assert status == 200
        last = text if isinstance(text, dict) else json.loads(text.strip().splitlines()[-1])
        assert last["finish_reason"] == "error" and "died" in last["error"], last
        role = http("GET", d.url + "/debug/state")[1]["engine"]["role"]
        assert role["stats"]["stale"].get("pong_engine_stalled", 0) >= 3, role["stats"]
        assert http("GET", d.url + "/health")[0] == 200
