"""early-reset: a storm of clients that reset their connection right after sending.

Each round sends `--resets` completions (distinct prompts, `max_tokens` as long as the model's
context allows, `ignore_eos`), at most RESET_CONCURRENCY at once, to each target: the router,
and also each co-located worker directly when the cluster has no prefill worker (the two
front ends are one code, but each process has its own handler tasks). Every connection ends
with an RST (SO_LINGER 0), each in one window of its request's life, in turn:

  stream-sent   a streaming request, reset right after its last byte is sent: the response
                has not started (the case a storm of killed clients makes);
  plain-sent    the same for a non-streaming request;
  stream-head   reset once the response head arrived: the answer started, no token read;
  stream-token  reset after the first SSE event.

Checks, per target and round (LESSONS #17): within `reset_bound_s` of the last reset every
worker is quiescent (/debug/invariants: no live request, no open room, every page free) and
the router holds nothing; no thread died; a fresh request is answered within
`fresh_bound_s`. Without the fix this scenario guards, the requests ran on to `max_tokens`
with no client and held the pool.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from pdserve.chaos import probes
from pdserve.chaos.cluster import ClusterSpec, WorkerRef
from pdserve.chaos.scenarios import ChaosOptions, Context, Outcome
from pdserve.runtime import httpcall

WINDOWS = ("stream-sent", "plain-sent", "stream-head", "stream-token")
RESET_CONCURRENCY = 200  # connections open at once during the storm
CONNECT_S = 10.0  # one connection's open
READ_S = 30.0  # the head or first event of one answer, under the storm's load
MAX_TOKENS = 2000  # each request asks this many (less where the context is shorter)
_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, not FIN


@dataclass(frozen=True)
class Target:
    url: str
    what: str  # "router" or "co-located worker <url>"


def request_bytes(url: str, window: str, n: int, max_tokens: int, auth: dict[str, str]) -> bytes:
    """The n-th request of a storm as raw HTTP/1.1 (its own prompt: no prefix-cache hit)."""
    body = json.dumps(
        {
            "prompt": f"reset {n}: tell me a long story about the number {n}",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": window != "plain-sent",
        }
    ).encode()
    u = urlparse(url)
    head = [
        "POST /v1/completions HTTP/1.1",
        f"Host: {u.hostname}:{u.port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in auth.items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def reset_one(url: str, window: str, payload: bytes, pause_s: float = 0.0) -> None:
    """Send one request and reset its connection in `window` (`pause_s` after it is reached);
    raises OSError/TimeoutError if the server did not let it get that far."""
    u = urlparse(url)
    async with asyncio.timeout(CONNECT_S):
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
    try:
        writer.write(payload)
        await writer.drain()
        if window in ("stream-head", "stream-token"):
            async with asyncio.timeout(READ_S):
                await reader.readuntil(b"\r\n\r\n")
                if window == "stream-token":
                    await reader.readuntil(b"\n\n")  # the first SSE event
        if pause_s:
            await asyncio.sleep(pause_s)
    finally:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
        writer.transport.abort()


async def storm(url: str, resets: int, first: int, max_tokens: int) -> Counter[str]:
    """`resets` early resets against `url`, windows in turn; counts per window and failures."""
    auth = httpcall.auth_headers()
    gate = asyncio.Semaphore(RESET_CONCURRENCY)
    counts: Counter[str] = Counter()

    async def one(n: int) -> None:
        window = WINDOWS[n % len(WINDOWS)]
        async with gate:
            try:
                payload = request_bytes(url, window, first + n, max_tokens, auth)
                await reset_one(url, window, payload)
                counts[window] += 1
            except (OSError, TimeoutError, asyncio.IncompleteReadError) as e:
                counts[f"failed: {type(e).__name__}"] += 1

    await asyncio.gather(*(one(n) for n in range(resets)))
    return counts


def targets(router: str, workers: list[WorkerRef]) -> list[Target]:
    """The router, and each co-located worker's own front end (a cluster without P)."""
    out = [Target(router, "router")]
    if not any(w.role == "prefill" for w in workers):
        out += [Target(w.url, f"co-located worker {w.url}") for w in workers]
    return out


def context_tokens(url: str) -> int:
    """max_tokens for the storm: MAX_TOKENS, or what the model's context leaves a prompt."""
    r = httpcall.get(url + "/v1/models", probes.CALL_S)
    cards = r.body.get("data", []) if isinstance(r.body, dict) else []
    limit = int(cards[0].get("max_model_len", 0)) if cards else 0
    return min(MAX_TOKENS, limit - 64) if limit > 128 else MAX_TOKENS


class EarlyReset:
    name = "early-reset"
    destructive = False
    needs_launch = False

    def spec(self, opts: ChaosOptions) -> ClusterSpec:
        return opts.base_spec()

    def unfit(self, workers: list[WorkerRef]) -> str | None:
        return None

    def run(self, ctx: Context, out: Outcome) -> None:
        router = ctx.cluster.url
        workers = ctx.workers()
        max_tokens = context_tokens(router)
        sent = 0
        for rnd in range(ctx.opts.rounds):
            for target in targets(router, workers):
                rec = self.one(ctx, out, router, workers, target, sent, max_tokens)
                sent += ctx.opts.resets
                rec["round"] = rnd + 1
                out.rounds.append(rec)
                ctx.say(
                    f"round {rnd + 1}: {ctx.opts.resets} resets at the {target.what}: "
                    + ("ok" if rec["ok"] else "VIOLATION")
                    + f", quiet after {rec['quiet_after_s']}s, fresh in {rec['fresh_s']}s"
                )
        quiet = [r["quiet_after_s"] for r in out.rounds]
        fresh = [r["fresh_s"] for r in out.rounds]
        out.summary = {
            "headline": (
                f"{len(out.rounds)} storms of {ctx.opts.resets} early resets: quiet after "
                f"max {max(quiet, default=None)}s, a fresh request in max "
                f"{max(fresh, default=None)}s"
            ),
            "resets_per_storm": ctx.opts.resets,
            "windows": list(WINDOWS),
        }
        if not out.ok:
            out.diagnosis = ctx.diagnose()

    def one(
        self,
        ctx: Context,
        out: Outcome,
        router: str,
        workers: list[WorkerRef],
        target: Target,
        first: int,
        max_tokens: int,
    ) -> dict[str, Any]:
        opts = ctx.opts
        t0 = time.monotonic()
        counts = asyncio.run(storm(target.url, opts.resets, first, max_tokens))
        rec: dict[str, Any] = {
            "target": target.what,
            "storm_s": round(time.monotonic() - t0, 3),
            "resets": dict(counts),
        }
        where = f"{opts.resets} resets at the {target.what}"
        quiet = probes.wait_quiet(router, [w.url for w in workers], opts.reset_bound_s)
        rec["quiet_after_s"] = quiet.after_s
        if not quiet.ok:
            shown = "; ".join(quiet.violations[:6])
            out.violate(f"{where}: not quiet {opts.reset_bound_s}s after the storm: {shown}")
        for w in workers:
            bad = probes.dead_threads(w.url)
            if bad:
                out.violate(f"{where}: {w.url} threads crashed or dead: {bad}")
        t1 = time.monotonic()
        fresh = probes.fresh_completion(target.url)
        rec["fresh_s"] = round(time.monotonic() - t1, 3)
        if fresh:
            out.violate(f"{where}: the next request failed: {fresh}")
        elif rec["fresh_s"] > opts.fresh_bound_s:
            out.violate(f"{where}: the next request took {rec['fresh_s']}s")
        rec["ok"] = quiet.ok and not fresh and rec["fresh_s"] <= opts.fresh_bound_s
        return rec
