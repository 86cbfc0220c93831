"""`make run` works: the demo launches a 1P+1D cluster on the real built-in model
(builtin:smollm2-135m-instruct), sends its requests and stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


def test_the_demo_runs_end_to_end(model_cache):
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: stopped as one, whatever happens
    )
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, out[-3000:]
    # The greedy chat answer, through the chat template, the router and both workers.
    question, answer = out.split("-- chat (greedy)\n", 1)[1].split("\n")[:2]
    assert question == "What is the capital of France?" and "Paris" in answer, out[-3000:]
    assert "16 requests, 1024 tokens" in out and "KV written to decode workers" in out, out[-2000:]
    assert "== server stopped (exit code 0)" in out
