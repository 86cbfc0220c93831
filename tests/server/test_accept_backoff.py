"""At the descriptor limit, accept() backs off and logs one line a second, then recovers.

A server process with RLIMIT_NOFILE lowered to 128 and a connection cap above it (so that it
does run out of descriptors) is flooded with connections it cannot all accept. Python 3.11's
loop alone retried accept() up to `backlog` times per tick and logged a traceback each time
(LESSONS: a flood at the limit once wrote 230 MB of log in a minute); with
`listener.AcceptSocket` it logs one line per back-off, and serves again once the flood ends.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

SERVER = r"""
import asyncio, resource, sys
from aiohttp import web
from pdserve.runtime import logs
from pdserve.server.listener import HttpLimits, Listener, bind

resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
logs.setup("INFO")

async def hello(request):
    return web.json_response({"ok": True})

async def main():
    listener = Listener(bind("127.0.0.1", 0), HttpLimits(max_connections=10_000))
    app = web.Application(middlewares=[listener.middleware()])
    app.add_routes([web.get("/hello", hello)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await listener.start(runner)
    print(listener.port, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""
FLOOD = 400  # connections held open at once: far past 128 descriptors
HOLD_S = 2.5


def test_accept_at_the_descriptor_limit_backs_off_quietly_and_recovers(tmp_path):
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, stderr=log, text=True
        )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        flood = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(FLOOD)]
        time.sleep(HOLD_S)  # the server sits at its limit with connections waiting
        for s in flood:
            s.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/hello", timeout=10) as r:
            assert r.status == 200  # it accepts again once descriptors are free
        lines = log_path.read_text().splitlines()
        backoffs = [line for line in lines if "cannot accept connections" in line]
        assert backoffs, "the flood should have reached the descriptor limit"
        assert len(backoffs) <= 2 * HOLD_S + 3, lines[:20]  # about one a second, not per try
        assert not [line for line in lines if "Traceback" in line or "ERROR" in line]
    finally:
        proc.kill()
        proc.wait(10)
