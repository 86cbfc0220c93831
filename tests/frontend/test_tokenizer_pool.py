"""The front end's tokenizer threads (frontend/tokenizer_pool.py): results and errors reach
the awaiting task, a call dropped before a thread takes it never runs, and a process does not
wait at exit for a call that never ends (a server told to stop mid-tokenize stops)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading

import pytest

from pdserve.frontend.tokenizer_pool import TokenizerPool

WAIT_S = 10.0


def test_results_and_errors_reach_the_awaiting_task():
    pool = TokenizerPool(2)

    def fail(x: str) -> int:
        raise ValueError(f"bad {x}")

    async def go() -> None:
        assert await pool.run(len, "abcd") == 4
        assert await asyncio.gather(*(pool.run(str.upper, s) for s in "xyz")) == ["X", "Y", "Z"]
        with pytest.raises(ValueError, match="bad q"):
            await pool.run(fail, "q")

    try:
        asyncio.run(go())
    finally:
        pool.close()


def test_a_call_cancelled_before_a_thread_takes_it_never_runs():
    pool = TokenizerPool(1)
    gate, ran = threading.Event(), []

    def hold(x: str) -> str:
        assert gate.wait(WAIT_S)
        ran.append(x)
        return x

    async def go() -> None:
        first = asyncio.ensure_future(pool.run(hold, "first"))
        await asyncio.sleep(0.05)  # the one thread is inside `hold`
        second = asyncio.ensure_future(pool.run(hold, "second"))
        await asyncio.sleep(0.05)
        assert pool.queued() == 1
        second.cancel()  # its client left
        await asyncio.sleep(0.05)
        gate.set()
        assert await asyncio.wait_for(first, WAIT_S) == "first"
        third = await asyncio.wait_for(pool.run(hold, "third"), WAIT_S)
        assert third == "third" and ran == ["first", "third"]

    try:
        asyncio.run(go())
    finally:
        gate.set()
        pool.close()


@pytest.mark.process
def test_a_process_does_not_wait_at_exit_for_a_call_that_never_ends():
    script = textwrap.dedent(
        """
        import asyncio, threading
        from pdserve.frontend.tokenizer_pool import TokenizerPool
        pool = TokenizerPool(1)
        started = threading.Event()
        def forever(x):
            started.set()
            threading.Event().wait()
        async def main():
            task = asyncio.ensure_future(pool.run(forever, "x"))
            await asyncio.to_thread(started.wait, 10)
            task.cancel()
        asyncio.run(main())
        print("main done", flush=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5.0)
    assert proc.returncode == 0 and "main done" in out
