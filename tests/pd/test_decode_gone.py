"""A decode worker that dies mid-transfer: P fails every room of it at once, then pairs anew.

On nixl the transfer layer tells P the peer disconnected (a typed NIXL error) on the first
write or poll that touches it. P must not wait for each of that peer's rooms to hit its own
error or deadline, nor for the 15 s of silence that declares a peer dead: it drops the peer
and fails all its rooms then, frees their pages, and a new decode worker pairs with it
without P restarting.
"""

from __future__ import annotations

import threading
import time
from http.client import HTTPException

import pytest

from tests.pd.conftest import CHUNK, PD, tokens
from tests.procs import ServerProcess, http, worker_args

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

PROMPT = 900  # tokens: ~19 chunks of 48, each write delayed, so rooms stay open for seconds
IN_FLIGHT = 6


def p_state(p: ServerProcess) -> dict:
    return http("GET", p.url + "/debug/state")[1]["engine"]["role"]


@pytest.mark.parametrize("backend", ["nixl"])
def test_a_disconnected_decode_worker_fails_all_its_rooms_at_once(backend, tiny_dir, tmp_path):
    common = worker_args(tiny_dir, backend, CHUNK)
    slow_writes = {"PDSERVE_FAULTS": "p.write=delay:0.05"}  # P's engine sleeps 50 ms per write
    p_args = ["serve", "--role", "prefill", *common]
    with ServerProcess(p_args, tmp_path / "p.log", env=slow_writes) as p:
        control = http("GET", p.url + "/info")[1]["control"]
        prompt = [5 + i % 200 for i in range(PROMPT)]
        with ServerProcess(["serve", "--role", "decode", *common], tmp_path / "d1.log") as d1:
            want = tokens(PD(p, d1, control, backend).generate("ref", prompt, max_tokens=4))
            pd = PD(p, d1, control, backend)

            ended: list[str] = []  # how each doomed request ended (appends are atomic)

            def doomed(i: int) -> None:
                try:
                    # Its own first token: P's prefix cache must not serve it from "ref".
                    own = [300 + i, *prompt[1:]]
                    lines = pd.generate(f"doomed-{i}", own, max_tokens=4, timeout=60)
                    ended.append(lines[-1]["finish_reason"] if lines else "cut off")
                except (OSError, HTTPException, ValueError) as e:  # D is killed under it
                    ended.append(f"connection: {type(e).__name__}")

            clients = [threading.Thread(target=doomed, args=(i,)) for i in range(IN_FLIGHT)]
            for t in clients:
                t.start()
            deadline = time.monotonic() + 30
            while len(p_state(p)["rooms"]) < 3:
                assert time.monotonic() < deadline, "P never had 3 rooms open at once"
                time.sleep(0.02)
            d1.proc.kill()  # type: ignore[union-attr]
            d1.proc.wait(10)  # type: ignore[union-attr]
            killed = time.monotonic()
            while p_state(p)["rooms"]:
                # 10 s: well inside the 15 s of silence that would also drop the peer
                assert time.monotonic() - killed < 10, f"P still has rooms: {p_state(p)['rooms']}"
                time.sleep(0.05)
            for t in clients:
                t.join(60)
            assert len(ended) == IN_FLIGHT, ended  # every client came back, none hangs
        state = p_state(p)
        # Dropped because the transfer layer said so, not after 15 s of silence.
        assert state["stats"]["peers_dropped"] == {"disconnected": 1}, state["stats"]
        assert state["peers"] == []
        # A new decode worker pairs with the same P, which did not restart.
        with ServerProcess(["serve", "--role", "decode", *common], tmp_path / "d2.log") as d2:
            pd2 = PD(p, d2, control, backend)
            assert tokens(pd2.generate("after", prompt, max_tokens=4)) == want
            pd2.wait_quiet()
        assert p.stop() == 0  # and P still shuts down cleanly (UCX did not abort it)
