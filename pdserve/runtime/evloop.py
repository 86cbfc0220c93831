"""Which asyncio event loop a process runs: uvloop or asyncio's own.

Every token a server streams crosses event loops: the worker's (its NDJSON line to the router),
the router's (an SSE event to the client), the bench client's. uvloop (libuv, in C) runs the
same coroutines with cheaper transports, callbacks and polling, as vLLM's and SGLang's API
servers do, and each of those loops spends less CPU per streamed token on it
(benchmarks/RESULTS.md, 2026-12-02 fourth session).

But a worker's loop shares one interpreter lock with the engine thread, and there what counts
is how long the loop *holds* the lock: asyncio's socket writes release it for the syscall,
uvloop's do not. On uvloop, then, a worker's loop holds the lock longer, for less CPU, and the
engine's tick, hence the served inter-token gap, grows (benchmarks/RESULTS.md, 2026-12-02
fourth and fifth sessions). So by default (`auto`) the router and `pdserve bench` run uvloop
where it is installed and a worker runs asyncio's loop. A worker whose engine runs in a
process of its own (CUDA's default, worker/host/client.py) has no engine thread beside its
loop, so the reason is gone there; the two loops cost such a worker the same within the runs'
spread, so it keeps asyncio's until a measurement tells them apart (benchmarks/RESULTS.md,
2026-12-05 f).
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
