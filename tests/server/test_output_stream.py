"""server/output_stream.py: one loop wake-up per burst of outputs from another thread, a
stream that hands over everything waiting at once, its one deadline, and exact merging."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.protocol.outputs import RequestOutput, TokenLogprob
from pdserve.server.output_stream import (
    OutputStream,
    StreamTimeout,
    handoff,
    merge,
    merge_runs,
)


def out(toks: tuple[int, ...], finish: str | None = None, prompt_lp: int = 0) -> RequestOutput:
    lps = tuple(TokenLogprob(t, -float(t), ((t, -float(t)),)) for t in toks)
    plps = tuple(TokenLogprob(t, -1.0, ()) for t in range(prompt_lp))
    return RequestOutput("r", toks, lps, finish, "why" if finish == "error" else None, 5, plps)


def test_a_burst_from_another_thread_wakes_the_loop_once_in_order() -> None:
    async def go() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        wakes = 0
        real = loop.call_soon_threadsafe

        def counting(*a, **k):  # type: ignore[no-untyped-def]
            nonlocal wakes
            wakes += 1
            return real(*a, **k)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        got: list[int] = []
        done = asyncio.Event()
        h = handoff(loop)

        def deliver(i: int) -> None:
            got.append(i)
            if i == 999:
                done.set()

        t = threading.Thread(target=lambda: [h.push(deliver, i) for i in range(1000)])
        t.start()  # the loop is not running until the wait below: one drain takes them all
        t.join(10)
        await asyncio.wait_for(done.wait(), 10)
        return got, wakes

    got, wakes = asyncio.run(go())
    assert got == list(range(1000))
    assert wakes == 1


def test_pushes_from_the_loop_thread_do_not_use_the_self_pipe() -> None:
    async def go() -> list[int]:
        loop = asyncio.get_running_loop()
        loop.call_soon_threadsafe = None  # type: ignore[assignment,method-assign]
        got: list[int] = []
        h = handoff(loop)
        for i in range(3):
            h.push(got.append, i)
        await asyncio.sleep(0)
        return got

    assert asyncio.run(go()) == [0, 1, 2]


def test_take_hands_over_everything_waiting_and_then_waits() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        s: OutputStream[int] = OutputStream(loop, loop.time() + 10)
        for i in range(5):
            s.put(i)
        assert await s.take() == [0, 1, 2, 3, 4]
        waiting = asyncio.ensure_future(s.take())
        await asyncio.sleep(0)
        assert not waiting.done()
        s.put(7)
        assert await asyncio.wait_for(waiting, 5) == [7]
        s.close()

    asyncio.run(go())


def test_the_deadline_ends_a_stream_only_once_it_is_empty() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        s: OutputStream[int] = OutputStream(loop, loop.time() + 0.01)
        s.put(1)
        await asyncio.sleep(0.05)
        assert await s.take() == [1]  # what came before the deadline is not lost
        with pytest.raises(StreamTimeout):
            await asyncio.wait_for(s.take(), 5)

    asyncio.run(go())


def test_merge_concatenates_in_order_and_keeps_the_last_finish() -> None:
    m = merge([out((1,), prompt_lp=3), out((2, 3)), out((4,), "error")])
    assert m.token_ids == (1, 2, 3, 4)
    assert [x.token_id for x in m.logprobs] == [1, 2, 3, 4]
    assert len(m.prompt_logprobs) == 3
    assert (m.finish_reason, m.error, m.num_prompt_tokens) == ("error", "why", 5)
    one = out((9,))
    assert merge([one]) is one


def test_merge_runs_never_merges_past_a_finish() -> None:
    runs = merge_runs([out((1,)), out((2,), "stop"), out((3,))])
    assert [r.token_ids for r in runs] == [(1, 2), (3,)]
    assert [r.finish_reason for r in runs] == ["stop", None]


def test_a_push_from_the_loop_waits_behind_a_pending_drain() -> None:
    async def go() -> list[str]:
        loop = asyncio.get_running_loop()
        got: list[str] = []
        h = handoff(loop)
        t = threading.Thread(target=lambda: h.push(got.append, "engine"))
        t.start()
        t.join(10)  # its drain is queued on the loop, not run yet
        h.push(got.append, "loop")
        await asyncio.sleep(0)
        return got

    assert asyncio.run(go()) == ["engine", "loop"]


def test_a_delivery_that_raises_loses_none_of_the_others() -> None:
    async def go() -> list[int]:
        loop = asyncio.get_running_loop()
        got: list[int] = []
        done = asyncio.Event()
        h = handoff(loop)

        def deliver(i: int) -> None:
            if i == 1:
                raise RuntimeError("a broken sink")
            got.append(i)
            if i == 3:
                done.set()

        t = threading.Thread(target=lambda: [h.push(deliver, i) for i in range(4)])
        t.start()
        t.join(10)
        await asyncio.wait_for(done.wait(), 10)
        return got

    assert asyncio.run(go()) == [0, 2, 3]


def test_a_loop_that_ended_is_not_kept_alive_by_its_handoff() -> None:
    import gc
    import weakref

    async def go() -> weakref.ref[asyncio.AbstractEventLoop]:
        loop = asyncio.get_running_loop()
        handoff(loop)
        return weakref.ref(loop)

    ref = asyncio.run(go())
    gc.collect()
    assert ref() is None
