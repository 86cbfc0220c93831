"""The router loads no torch: neither its modules nor its running process.

torch was 1.9 s of the router's 2.4 s start, and the router never computes: the wire types
it shares with the workers live in the torch-free pdserve/protocol/.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import ServerProcess, http

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

ROUTER_MODULES = (
    "pdserve.router.app",
    "pdserve.router.cli",
    "pdserve.model.tokenizer",
    "pdserve.protocol.sampling",
    "pdserve.protocol.outputs",
)


def test_router_modules_import_no_torch() -> None:
    code = (
        "import importlib, json, sys\n"
        f"for name in {ROUTER_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(out.stdout) == []


def test_a_running_router_maps_no_libtorch(
    tiny_server: ServerProcess, tiny_dir: Path, tmp_path: Path
) -> None:
    args = ["router", "--decode", tiny_server.url, "--model", str(tiny_dir)]
    with ServerProcess(args, tmp_path / "router.log") as router:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0}
        status, resp = http("POST", router.url + "/v1/completions", body)
        assert status == 200, resp
        maps = Path(f"/proc/{router.pid}/maps").read_text()
        assert "libtorch" not in maps
        assert "libtorch" in Path(f"/proc/{tiny_server.pid}/maps").read_text()  # it can fail
