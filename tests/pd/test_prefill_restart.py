"""A prefill worker that dies and comes back on the same address is paired with again.

The decode worker still holds a registration for that address; the new process has never
heard of it and refuses PrefillRequests as unregistered. D must then register again and
carry on without a restart of its own. Run on nixl, where pairing again also means a new
agent's metadata to load (the D logic is the same for every backend).
"""

from __future__ import annotations

import socket
import time

import pytest

from tests.pd.conftest import CHUNK, PD, tokens
from tests.procs import ServerProcess, http, worker_args

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("backend", ["nixl"])
def test_decode_pairs_again_with_a_restarted_prefill_worker(backend, tiny_dir, tmp_path):
    common = worker_args(tiny_dir, backend, CHUNK)
    port = str(free_port())
    p_args = ["serve", "--role", "prefill", "--control-port", port, *common]
    with ServerProcess(["serve", "--role", "decode", *common], tmp_path / "d.log") as d:
        with ServerProcess(p_args, tmp_path / "p1.log") as p1:
            pd = PD(p1, d, http("GET", p1.url + "/info")[1]["control"], backend)
            want = tokens(pd.generate("before", list(range(5, 80)), max_tokens=6))
            p1.proc.kill()  # type: ignore[union-attr]
            p1.proc.wait(10)  # type: ignore[union-attr]
        with ServerProcess(p_args, tmp_path / "p2.log") as p2:
            pd = PD(p2, d, pd.control, backend)  # same address, a new process
            t0 = time.monotonic()
            got = tokens(pd.generate("after", list(range(5, 80)), max_tokens=6))
            assert got == want  # the first request after the restart already succeeds
            assert time.monotonic() - t0 < 30
            pd.wait_quiet()
