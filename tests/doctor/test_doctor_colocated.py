"""`pdserve doctor --url` on a real co-located server (no router): healthy is exit 0, the
saved document reads back the same, and a missing key is exit 3 with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.runtime.cluster_key import KEY_FILE_ENV
from tests.procs import ServerProcess

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


def doctor(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", "doctor", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_doctor_on_a_colocated_server(tiny_server: ServerProcess, tmp_path: Path) -> None:
    saved = tmp_path / "server.json"
    done = doctor("--url", tiny_server.url, "--save", str(saved))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    lines = out.splitlines()
    assert lines[1].startswith(f"co-located server {tiny_server.url} (pid {tiny_server.pid})")
    assert "read directly (no router)" in lines[1]
    assert lines[2].startswith(f"co-located server {tiny_server.url} (pid {tiny_server.pid})")
    assert ": healthy; 0 requests, 0 rooms" in lines[2], out
    assert lines[-1].startswith("VERDICT: healthy")

    again = doctor("--file", str(saved), "--json")
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads(again.stdout)["workers"] == [lines[2]]


def test_doctor_without_the_servers_key_is_exit_3(tiny_server: ServerProcess) -> None:
    # The test run's servers hold its cluster key (tests/conftest.py): /debug/* needs it.
    env = {k: v for k, v in os.environ.items() if k not in (KEY_FILE_ENV, "PDSERVE_API_KEY")}
    done = doctor("--url", tiny_server.url, env=env)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "HTTP 401, a key is needed: pass --api-key, or set $PDSERVE_CLUSTER_KEY_FILE" in (
        done.stdout
    )
    assert done.stdout.splitlines()[-1].startswith("VERDICT: unknown")
