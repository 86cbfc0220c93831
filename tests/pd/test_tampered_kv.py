"""tcp backend: a decode worker writes no KV page that does not match its signed digest.

A fake prefill worker holding the cluster key pairs with a real decode worker and answers its
PrefillRequests itself. One KV frame it alters after signing its digest: D's stager refuses
the chunk and the request fails, naming it. The same flow with every frame intact decodes,
so the refusal is the digest's doing, and D stays healthy throughout.
"""

from __future__ import annotations

import json
import threading

import pytest
import zmq

from pdserve.kvcache.layout import KVLayout
from pdserve.protocol import messages as m
from pdserve.transfer.bulk import Bulk
from tests.pd.conftest import CHUNK, KeyedSocket
from tests.procs import ServerProcess, worker_args
from tests.procs import http as call

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


def last_line(reply: object) -> dict:
    if isinstance(reply, dict):
        return reply
    assert isinstance(reply, str), reply
    return json.loads(reply.strip().splitlines()[-1])


class FakePrefill:
    """A ROUTER socket that plays P for one decode worker: pairing, then each room's replies."""

    def __init__(self) -> None:
        self.sock = KeyedSocket(zmq.ROUTER, "fake-prefill")
        port = self.sock.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.ident: bytes | None = None
        self.page_bytes = 0

    def recv(self) -> m.Message:
        ident, frames = self.sock.recv()
        self.ident = ident
        msg = m.decode(frames[0])
        assert not isinstance(msg, m.DecodeError), msg
        return msg

    def send(self, msg: m.Msg) -> None:
        self.sock.send(m.encode(msg), to=self.ident)

    def pair(self) -> None:
        hello = self.recv()
        assert isinstance(hello, m.Hello), hello
        self.send(m.HelloAck(nonce=hello.nonce, address=self.address))
        reg = self.recv()
        assert isinstance(reg, m.Register) and reg.backend == "tcp", reg
        self.page_bytes = KVLayout.from_desc(reg.layout).page_bytes
        self.send(m.RegisterAck(ok=True, layout=reg.layout))

    def answer(self, tamper: bool) -> None:
        """Take the next PrefillRequest (Pings aside) and send its KV and PrefillDone."""
        req = self.recv()
        while not isinstance(req, m.PrefillRequest):
            req = self.recv()
        self.send(m.PrefillAccept(room=req.room, epoch=req.epoch))
        pages = [bytes([i % 251]) * self.page_bytes for i in range(len(req.dst_pages))]
        bulk = Bulk.seal(pages)
        if tamper:  # altered after its digest was signed: on the wire, as a MITM would
            pages[-1] = b"\xff" + pages[-1][1:]
        chunk = m.KVChunk(room=req.room, epoch=req.epoch, dst_pages=req.dst_pages)
        signed = self.sock.auth.sign([m.encode(chunk)], bulk.digests)
        assert self.ident is not None
        self.sock.sock.send_multipart([self.ident, *signed, *pages])
        kv_bytes = len(pages) * self.page_bytes
        self.send(m.PrefillDone(room=req.room, epoch=req.epoch, first_token=5, kv_bytes=kv_bytes))

    def close(self) -> None:
        self.sock.close()


def test_a_kv_frame_altered_after_signing_fails_its_request(tiny_dir, tmp_path):
    fake = FakePrefill()
    d = ServerProcess(
        ["serve", "--role", "decode", *worker_args(tiny_dir, "tcp", CHUNK, kv_mb=8)],
        tmp_path / "d.log",
    )
    d.__enter__()
    try:
        results: list[object] = []

        def generate(rid: str) -> None:
            body = {
                "request_id": rid,
                "prompt_ids": list(range(5, 60)),
                "prefill": fake.address,
                "params": {"max_tokens": 3, "temperature": 0},
            }
            results.append(call("POST", d.url + "/generate", body, timeout=30))

        for i, tamper in enumerate((True, False)):
            t = threading.Thread(target=generate, args=(f"r{i}",), daemon=True)
            t.start()
            if i == 0:
                fake.pair()
            fake.answer(tamper)
            t.join(30)
            assert not t.is_alive()
        (s1, bad), (s2, good) = results  # type: ignore[misc]
        assert s1 == 200 and s2 == 200
        bad, good = last_line(bad), last_line(good)
        assert bad["finish_reason"] == "error", bad
        assert "bad KV chunk" in bad["error"] and "does not match its digest" in bad["error"]
        assert good["finish_reason"] == "length", good
        state = call("GET", d.url + "/debug/state")[1]
        assert all(t["alive"] and t["crashes"] == 0 for t in state["threads"]), state["threads"]
        stager = state["engine"]["role"]["stager"]
        assert (stager["staged"], stager["refused"], stager["waiting"]) == (1, 1, 0), stager
        assert call("GET", d.url + "/health")[0] == 200
    finally:
        d.stop()
        fake.close()
