"""tcp backend: a decode worker never decodes on KV it did not receive.

Every KVChunk is dropped on arrival (a fault point), so each PrefillDone reports more bytes
than arrived: the request must fail with an error naming the shortfall — never stream tokens
computed on incomplete KV (P's first token, computed on the whole prompt, may go ahead) — and
the pages must come back.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.pd.conftest import CHUNK, PD
from tests.procs import ServerProcess, auth_headers, worker_args
from tests.procs import http as call

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


def test_dropped_kv_chunks_fail_the_request(tiny_dir, tmp_path):
    common = worker_args(tiny_dir, "tcp", CHUNK, kv_mb=8)
    with ServerProcess(["serve", "--role", "prefill", *common], tmp_path / "p.log") as p:
        d = ServerProcess(
            ["serve", "--role", "decode", *common],
            tmp_path / "d.log",
            env={"PDSERVE_FAULTS": "control.recv.KVChunk=drop"},
        )
        d.__enter__()
        try:
            pd = PD(p, d, call("GET", p.url + "/info")[1]["control"], "tcp")
            body = {
                "request_id": "lost",
                "prompt_ids": list(range(5, 80)),
                "prefill": pd.control,
                "params": {"max_tokens": 4, "temperature": 0},
            }
            req = urllib.request.Request(
                d.url + "/generate", json.dumps(body).encode(), auth_headers()
            )
            with urllib.request.urlopen(req, timeout=30) as r:
                lines = [json.loads(ln) for ln in r if ln.strip()]
            # At most P's first token, streamed ahead of the KV (FirstToken), perhaps in the
            # same line as the error; nothing decoded.
            assert sum(len(ln["token_ids"]) for ln in lines) <= 1
            assert lines[-1]["finish_reason"] == "error"
            assert "incomplete KV" in lines[-1]["error"]
            pd.wait_quiet()
        finally:
            d.stop()
