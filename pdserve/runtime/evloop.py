"""Which asyncio event loop a process runs: uvloop or asyncio's own.

Every token a server streams crosses event loops: the worker's (its NDJSON line to the router),
the router's (an SSE event to the client), the bench client's. uvloop (libuv, in C) runs the
same coroutines with cheaper transports, callbacks and polling, as vLLM's and SGLang's API
servers do. Measured on the 2-core VM (`python benchmarks/serving_overhead.py --concurrency
32 ...`, alternated runs): the router's loop spends 6% less CPU per streamed token on it (88.3
-> 83.2 ms per 1,000 tokens, four runs each: its time is aiohttp's and ours), the bench
client's 4% less, the worker's 27% less (38.9 -> 28.3).

But a worker's loop shares one interpreter lock with the engine thread, and there what counts
is how long the loop *holds* the lock: asyncio's socket writes release it for the syscall,
uvloop's do not. py-spy --gil on the worker's main thread (`--num-prompts 256 --output-len
256 --profile worker`, 250 Hz, two runs each) counted 136 and 143 samples holding the lock
with uvloop, 91 and 59 with asyncio: 1.5-2.4x longer held, for less CPU; on the H200 a
worker on uvloop served concurrency 32 at ITL p50 1.84/2.11 ms against 1.44/1.96 on asyncio
(benchmarks/RESULTS.md, 2026-12-02 fifth session). So by default (`auto`) the router and
`pdserve bench` run uvloop where it is installed and a worker runs asyncio's loop. A worker
whose engine runs in a process of its own (CUDA's default, worker/engine_client.py) has no
engine thread beside its loop, so the reason is gone there; on the 2-core VM such a worker's
loop spent 19.6 ms per 1,000 tokens on uvloop and 21.3 on asyncio's, inside the runs' spread
(benchmarks/RESULTS.md, 2026-12-05 f), so it keeps asyncio's until a GPU run tells them apart.
`PDSERVE_EVENT_LOOP=uvloop` or `=asyncio` puts the servers and `pdserve bench` on one loop (a
process started by `pdserve launch` inherits it; a bad value stops any `pdserve` command at
once); `uvloop` demands that it be installed.
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


def _setting() -> str:
    return os.environ.get(ENV, "").strip().lower() or "auto"


def chosen(default: str = "uvloop") -> str:
    """The loop this process will run: "uvloop" or "asyncio". `default` is what `auto` means
    for this process (uvloop falls back to asyncio where it is not installed). ValueError for
    a bad setting, or for "uvloop" demanded where it is not installed."""
    if default not in CHOICES[1:]:
        raise ValueError(f"default must be uvloop or asyncio, not {default!r}")
    want = _setting()
    if want not in CHOICES:
        raise ValueError(f"{ENV}={want!r}: expected one of {', '.join(CHOICES)}")
    have = importlib.util.find_spec("uvloop") is not None
    if want == "uvloop" and not have:
        raise ValueError(f"{ENV}=uvloop but uvloop is not installed (pip install uvloop)")
    if want == "auto":
        want = default
    return "uvloop" if want == "uvloop" and have else "asyncio"


def loop_factory(default: str = "uvloop") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A new loop of the chosen kind; None for asyncio's default. A uvloop that is found but
    does not import (a broken install) is asyncio under `auto`, an ImportError when demanded."""
    if chosen(default) == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if _setting() == "uvloop":
            raise
        log.warning("uvloop is installed but does not import; running asyncio's loop")
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]


def run(main: Coroutine[Any, Any, T], default: str = "uvloop") -> T:
    """`asyncio.run(main)` on the chosen loop, `default` standing for `auto` (ValueError or
    ImportError, `main` not started, for a setting that cannot be had)."""
    try:
        factory = loop_factory(default)
    except (ValueError, ImportError):
        main.close()  # never awaited: no "coroutine was never awaited" warning on the way out
        raise
    log.info("event loop: %s", "asyncio" if factory is None else "uvloop")
    if factory is None:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
