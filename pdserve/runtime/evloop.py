"""Which asyncio event loop a process runs: uvloop where it is installed, else asyncio's own.

Every token a server streams crosses event loops: the worker's (its NDJSON line to the router),
the router's (an SSE event to the client), the bench client's. In a worker the loop also
shares one interpreter lock with the engine thread, so what the loop spends per token is
taken from the engine's step. uvloop (libuv, in C) runs the same coroutines with cheaper
transports, callbacks and polling: the worker's loop spent 27% less CPU per streamed token with
it (`python benchmarks/serving_overhead.py --concurrency 32 --num-prompts 96 --output-len
128`, 2-core VM, four runs each, alternated: 38.9 -> 28.3 ms per 1,000 tokens), the router's
6% less (88.3 -> 83.2: its time is aiohttp's and ours, not the loop's). vLLM's and SGLang's
API servers run on it too.

`PDSERVE_EVENT_LOOP=asyncio` keeps asyncio's loop (uvloop's is the default when importable;
`uvloop` demands it). A process started by `pdserve launch` inherits the setting.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
ENV = "PDSERVE_EVENT_LOOP"
CHOICES = ("auto", "uvloop", "asyncio")


def chosen() -> str:
    """The loop this process will run: "uvloop" or "asyncio". ValueError for a bad setting,
    or for "uvloop" where it is not installed."""
    want = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if want not in CHOICES:
        raise ValueError(f"{ENV}={want!r}: expected one of {', '.join(CHOICES)}")
    have = importlib.util.find_spec("uvloop") is not None
    if want == "uvloop" and not have:
        raise ValueError(f"{ENV}=uvloop but uvloop is not installed (pip install uvloop)")
    return "uvloop" if want != "asyncio" and have else "asyncio"


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A new loop of the chosen kind; None for asyncio's default."""
    if chosen() == "asyncio":
        return None
    import uvloop

    return uvloop.new_event_loop  # type: ignore[no-any-return]


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the chosen loop (ValueError, `main` not started, for a bad
    PDSERVE_EVENT_LOOP)."""
    try:
        factory = loop_factory()
    except ValueError:
        main.close()  # never awaited: no "coroutine was never awaited" warning on the way out
        raise
    log.info("event loop: %s", "asyncio" if factory is None else "uvloop")
    if factory is None:
        return asyncio.run(main)
    if not hasattr(asyncio, "Runner"):  # Python 3.10
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
