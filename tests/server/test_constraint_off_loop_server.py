"""A real server's event loop answers while a request's constraint compiles
(frontend/constraint_threads.py): `pdserve serve` on the tiny model, whose compile step a
sitecustomize hook (on the server's PYTHONPATH only) holds for the test's specs until the test
lets it go; meanwhile /health, a plain completion and a plain /generate answer, and then the
held requests are served. A spec that does not compile is still a 400 naming its field.

The server binds 127.0.0.1 on a free port and is stopped by its pid (tests/procs.py), and a
held compile lets itself go after HOLD_S whatever the test does."""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.procs import ServerProcess, http

pytestmark = pytest.mark.process  # starts a server

HOLD_S = 8.0  # the longest a held compile waits (under the grammar thread's 10 s bound)
WAIT_S = 30.0  # the longest the test waits for anything

# Runs in the server at startup: a compile of a spec holding "slowmark<TAG>" marks
# TAG.started in the gate folder, waits for TAG.release (at most HOLD_S), marks TAG.finished.
HOOK = f"""
import os, pathlib, re, time
import pdserve.protocol.constraint as c

_gates = pathlib.Path(os.environ["PDSERVE_TEST_GATES"])
_inner = c._compile_error

def _held(kind, spec, *to_lark):
    m = re.search(r"slowmark([0-9a-f]+)", spec)
    if m:
        (_gates / (m[1] + ".started")).touch()
        deadline = time.monotonic() + {HOLD_S}
        while not (_gates / (m[1] + ".release")).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        (_gates / (m[1] + ".finished")).touch()
    return _inner(kind, spec, *to_lark)

c._compile_error = _held
"""


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} did not appear within {WAIT_S}s"
        time.sleep(0.02)


def others(url: str) -> list[int]:
    """The statuses of requests that ask for no constraint."""
    plain = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    generate = {"request_id": f"plain-{uuid.uuid4().hex}", "prompt_ids": [5, 6], "params": {}}
    return [
        http("GET", url + "/health", timeout=WAIT_S)[0],
        http("POST", url + "/v1/completions", plain, timeout=WAIT_S)[0],
        http("POST", url + "/generate", generate, timeout=WAIT_S)[0],
    ]


def held(tag: str) -> dict[str, dict[str, Any]]:
    """Per path, a request whose constraint's compile is held (its spec holds the mark)."""
    mark = f"slowmark{tag}"
    schema = {"type": "object", "properties": {mark: {"type": "string"}}}
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
    }
    generate = {
        "request_id": f"held-{tag}",
        "prompt_ids": [5, 6],
        "params": {"max_tokens": 2, "constraint": {"kind": "regex", "spec": f"{mark}|x"}},
    }
    return {"/v1/chat/completions": chat, "/generate": generate}


def test_a_server_answers_while_constraints_compile(tiny_dir: Path, tmp_path: Path) -> None:
    hook, gates = tmp_path / "hook", tmp_path / "gates"
    hook.mkdir()
    gates.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    path = [str(hook), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"PYTHONPATH": os.pathsep.join(path), "PDSERVE_TEST_GATES": str(gates)}
    args = ["serve", "--model", str(tiny_dir), "--served-model-name", "tiny"]
    args += ["--kv-budget-mb", "16", "--max-model-len", "1024"]
    tags = {"/v1/chat/completions": uuid.uuid4().hex, "/generate": uuid.uuid4().hex}
    with ServerProcess(args, tmp_path / "serve.log", env=env) as srv, ThreadPoolExecutor(1) as pool:
        try:
            for where, tag in tags.items():
                slow = pool.submit(http, "POST", srv.url + where, held(tag)[where], WAIT_S)
                wait_for(gates / f"{tag}.started")
                statuses = others(srv.url)
                answered_first = not (gates / f"{tag}.finished").exists()
                (gates / f"{tag}.release").touch()
                status, answer = slow.result(WAIT_S)
                assert statuses == [200, 200, 200], (where, statuses)
                assert answered_first, f"{where}: the others waited for its compile"
                assert status == 200, (where, answer)
        finally:  # a held compile lets go at once, so the server stops at once
            for tag in tags.values():
                (gates / f"{tag}.release").touch()
        bad = {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
        status, answer = http(
            "POST", srv.url + "/v1/chat/completions", {**body, "response_format": bad}
        )
        assert status == 400, answer
        assert answer["error"]["param"] == "response_format.json_schema.schema"
        assert "does not compile: Invalid type: objectx" in answer["error"]["message"]
