"""Startup discovery: read every worker's /info and decide whether they make one fleet.

The router refuses to start (RouterStartupError, exit code 2) rather than serve a fleet
that cannot work: decode workers serving different models, a prefill worker without a
control address, or roles that do not fit the topology (co-located workers when there is
no prefill pool; decode workers when there is one).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from pdserve.protocol.control_address import is_control_address
from pdserve.protocol.sampling import show
from pdserve.router.client import WorkerClient, WorkerError
from pdserve.router.config import RouterConfig
from pdserve.runtime.timing import DISCOVERY_RETRY_S, INFO_CALL_S


class RouterStartupError(ValueError):
    """The configured workers cannot be served as one fleet (the operator's fault)."""


@dataclass(frozen=True)
class Fleet:
    model: str  # the workers' model name
    max_model_len: int  # the smallest over decode workers
    vocab_size: int  # the smallest over decode workers
    decode: tuple[tuple[str, dict[str, Any]], ...]  # (url, /info)
    prefill: tuple[tuple[str, dict[str, Any]], ...]


async def discover(cfg: RouterConfig, clients: dict[str, WorkerClient]) -> Fleet:
    deadline = time.monotonic() + cfg.startup_timeout_s

    async def info(url: str) -> dict[str, Any]:
        last = "no attempt"
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                return await clients[url].info(min(remaining, INFO_CALL_S))
            except WorkerError as e:
                last = e.what
            await asyncio.sleep(min(DISCOVERY_RETRY_S, max(deadline - time.monotonic(), 0.0)))
        raise RouterStartupError(
            f"worker {url} did not answer GET /info within {cfg.startup_timeout_s:.0f}s "
            f"(last error: {last})"
        )

    decode = await asyncio.gather(*(info(u) for u in cfg.decode_urls))
    prefill = await asyncio.gather(*(info(u) for u in cfg.prefill_urls))
    return check_fleet(
        tuple(zip(cfg.decode_urls, decode, strict=True)),
        tuple(zip(cfg.prefill_urls, prefill, strict=True)),
    )


def check_fleet(
    decode: tuple[tuple[str, dict[str, Any]], ...],
    prefill: tuple[tuple[str, dict[str, Any]], ...],
) -> Fleet:
    want_role = "decode" if prefill else "colocated"
    for url, info in decode:
        if info.get("role") != want_role:
            why = "with --prefill workers" if prefill else "without --prefill workers"
            raise RouterStartupError(
                f"--decode worker {url} has role {info.get('role')!r}; {why} the router needs "
                f"role {want_role!r}"
            )
        for key in ("max_model_len", "vocab_size"):
            if not isinstance(info.get(key), int) or info[key] < 1:
                raise RouterStartupError(f"worker {url}: /info has no valid {key!r}: {info}")
    models = {info.get("model") for _, info in decode}
    if len(models) != 1:
        listing = ", ".join(f"{u}: {i.get('model')!r}" for u, i in decode)
        raise RouterStartupError(f"decode workers serve different models ({listing})")
    model = str(models.pop())
    for url, info in prefill:
        if info.get("role") != "prefill":
            raise RouterStartupError(
                f"--prefill worker {url} has role {info.get('role')!r}, not 'prefill'"
            )
        if info.get("model") != model:
            raise RouterStartupError(
                f"prefill worker {url} serves {info.get('model')!r}; decode workers serve {model!r}"
            )
        if not is_control_address(info.get("control")):
            raise RouterStartupError(
                f"prefill worker {url}: /info has no 'control' address tcp://HOST:PORT for "
                f"decode workers, got {show(info.get('control'))}"
            )
    return Fleet(
        model=model,
        # P computes the prompt, D the whole: a prompt must fit both (each caps its context by
        # its own pool, engine/sizing.py), or it passes here only to be refused by a worker.
        max_model_len=min(int(i["max_model_len"]) for _, i in [*decode, *prefill]),
        vocab_size=min(int(i["vocab_size"]) for _, i in decode),
        decode=decode,
        prefill=prefill,
    )
