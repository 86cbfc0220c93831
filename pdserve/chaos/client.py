"""The chaos load: many concurrent streaming multi-turn chat sessions against a router.

    python -m pdserve.chaos.client --url ROUTER --sessions 60 --progress FILE

Each session holds a conversation: every turn is a streaming /v1/chat/completions with the
conversation so far and a small max_tokens; after `--turns` turns it starts a new one. It
runs until `--duration` has passed, or until it is killed: the abort storm SIGKILLs it
mid-stream, so that every open stream dies at once in whatever state it was. SIGUSR1 ends a
run early the way `--duration` does (no new request; those in flight end within their bound;
`finished`), for a harness that decides when the load has done its part.

Because the harness kills us, we keep no result in memory only: the counters go to the
progress file every PROGRESS_S, written to a temporary name and renamed over it (a rename is
atomic, so a SIGKILL never leaves half a file). Every request has a client-side bound of its
own `timeout` plus a grace; one that runs past it is counted as hung and abandoned.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

PROGRESS_S = 0.2  # what a SIGKILL can lose, at most
GRACE_S = 10.0  # past a request's own timeout: the router's and worker's graces are 5 s each
STOP_S = 5.0  # --duration: how long open streams get to finish before we cancel them

# fmt: off
WORDS = (
    "queue", "page", "prefill", "decode", "token", "batch", "stream", "abort", "room", "fence",
    "lease", "deadline", "worker", "router", "cache", "layer", "kernel", "thread", "socket",
    "chunk", "write", "ack", "epoch", "pair", "health", "storm",
)
# fmt: on


@dataclass
class Progress:
    """Cumulative counters; what the harness reads back, even after a SIGKILL."""

    pid: int = field(default_factory=os.getpid)
    sessions: int = 0
    load_started_unix: float | None = None  # the first request went out
    elapsed_s: float = 0.0  # since load_started, at the last write
    finished: bool = False  # --duration passed (or SIGUSR1 came) and every stream ended
    started: int = 0
    ok: int = 0
    abandoned: int = 0  # closed by us on purpose mid-stream (--abandon)
    failed: int = 0  # every other end: see `errors`
    in_flight: int = 0
    # Tokens delivered: one per content chunk as it arrives (so a killed run still counts
    # its open streams), corrected to the usage count when a request finishes.
    completion_tokens: int = 0
    streamed_chunks: int = 0
    max_request_s: float = 0.0
    errors: Counter[str] = field(default_factory=Counter)  # kind -> count
    last_errors: list[str] = field(default_factory=list)  # a few messages, newest last

    def error(self, kind: str, message: str) -> None:
        self.failed += 1
        self.errors[kind] += 1
        self.last_errors = [*self.last_errors[-4:], f"{kind}: {message[:300]}"]

    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def write_progress(path: Path, p: Progress) -> None:
    tmp = path.with_name(path.name + ".tmp")
    doc = {**asdict(p), "errors": dict(p.errors), "tokens_per_s": round(p.tokens_per_s(), 2)}
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def read_progress(path: Path) -> dict[str, Any] | None:
    """The last progress the client wrote, or None if it never wrote any."""
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return doc


@dataclass(frozen=True)
class LoadConfig:
    url: str
    sessions: int
    turns: int
    max_tokens: int
    timeout_s: float
    abandon: float  # probability that a request is closed by us after its first chunk
    duration_s: float | None
    seed: int


async def one_request(
    http: aiohttp.ClientSession, cfg: LoadConfig, body: dict[str, Any], p: Progress, abandon: bool
) -> str | None:
    """Stream one chat turn; the assistant's text when it finished well, else None."""
    text: list[str] = []
    finish: str | None = None
    error: str | None = None
    async with http.post(cfg.url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            p.error(f"http_{r.status}", (await r.text())[:300])
            return None
        async for raw in r.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                error = str(obj["error"].get("message", obj["error"]))
            for ch in obj.get("choices") or ():
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    text.append(piece)
                    p.streamed_chunks += 1
                    p.completion_tokens += 1
                    if abandon:  # close mid-stream: the router must abort it on the worker
                        p.abandoned += 1
                        r.close()
                        return None
                finish = ch.get("finish_reason") or finish
            if obj.get("usage"):
                p.completion_tokens += int(obj["usage"]["completion_tokens"]) - len(text)
    if error is not None or finish not in ("stop", "length"):
        p.error("stream_error" if error else "no_finish", error or f"finish_reason {finish!r}")
        return None
    p.ok += 1
    return "".join(text)


async def run_session(
    i: int, http: aiohttp.ClientSession, cfg: LoadConfig, p: Progress, stop: asyncio.Event
) -> None:
    rng = random.Random(cfg.seed * 1_000_003 + i)
    await asyncio.sleep(rng.random() * 0.2)  # spread the first wave a little
    convo: list[dict[str, str]] = []
    while not stop.is_set():
        if len(convo) >= 2 * cfg.turns:
            convo = []
        convo.append(
            {"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 24)))}
        )
        body = {
            "messages": [{"role": "system", "content": f"session {i}"}, *convo],
            "max_tokens": rng.randint(max(1, cfg.max_tokens // 4), cfg.max_tokens),
            "temperature": 0.8,
            "seed": rng.randrange(2**31),
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "timeout": cfg.timeout_s,
        }
        if p.load_started_unix is None:
            p.load_started_unix = time.time()
        p.started += 1
        p.in_flight += 1
        t0 = time.monotonic()
        answer: str | None = None
        try:
            async with asyncio.timeout(cfg.timeout_s + GRACE_S):
                answer = await one_request(http, cfg, body, p, rng.random() < cfg.abandon)
        except TimeoutError:
            p.error("hung", f"no end within {cfg.timeout_s + GRACE_S:.0f}s")
        except aiohttp.ClientConnectorError as e:
            p.error("connect", repr(e))
            await asyncio.sleep(0.2)  # the router is gone; do not spin
        except (aiohttp.ClientError, ValueError) as e:  # broken stream, bad JSON
            p.error("broken", repr(e))
        finally:
            p.in_flight -= 1
            p.max_request_s = max(p.max_request_s, time.monotonic() - t0)
        if answer is None:
            convo.pop()  # retry the turn with a fresh user message
        else:
            convo.append({"role": "assistant", "content": answer})


async def main_async(cfg: LoadConfig, progress_path: Path) -> int:
    p = Progress(sessions=cfg.sessions)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, stop.set)
    t0 = time.monotonic()

    async def reporter() -> None:
        while True:
            if p.load_started_unix is not None:
                p.elapsed_s = round(time.time() - p.load_started_unix, 3)
            write_progress(progress_path, p)
            await asyncio.sleep(PROGRESS_S)

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.5), timeout=timeout
    ) as http:
        rep = asyncio.create_task(reporter())
        tasks = [
            asyncio.create_task(run_session(i, http, cfg, p, stop)) for i in range(cfg.sessions)
        ]
        if cfg.duration_s is None:
            await asyncio.gather(*tasks)  # until SIGKILL, or SIGUSR1 (each session then ends)
        else:
            left = max(0.0, cfg.duration_s - (time.monotonic() - t0))
            with contextlib.suppress(TimeoutError):  # the duration passed (or SIGUSR1 came)
                async with asyncio.timeout(left):
                    await stop.wait()
            stop.set()
            _, late = await asyncio.wait(tasks, timeout=cfg.timeout_s + GRACE_S + STOP_S)
            for t in late:
                t.cancel()
            if late:
                await asyncio.wait(late, timeout=STOP_S)
        p.finished = True
        rep.cancel()
        if p.load_started_unix is not None:
            p.elapsed_s = round(time.time() - p.load_started_unix, 3)
        write_progress(progress_path, p)
    return 0


def parse_args(argv: list[str] | None) -> tuple[LoadConfig, Path]:
    a = argparse.ArgumentParser(prog="python -m pdserve.chaos.client", description=__doc__)
    a.add_argument("--url", required=True, help="the router, e.g. http://127.0.0.1:8000")
    a.add_argument("--sessions", type=int, default=60)
    a.add_argument("--turns", type=int, default=4, help="turns before a session starts over")
    a.add_argument("--max-tokens", type=int, default=16)
    a.add_argument("--timeout", type=float, default=20.0, help="each request's own timeout")
    a.add_argument("--abandon", type=float, default=0.0, help="chance to close a stream early")
    a.add_argument("--duration", type=float, default=None, help="stop after this long")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--progress", required=True, help="JSON counters, rewritten as we go")
    ns = a.parse_args(argv)
    if ns.sessions < 1 or ns.max_tokens < 1 or ns.timeout <= 0 or not 0 <= ns.abandon <= 1:
        a.error("need --sessions >= 1, --max-tokens >= 1, --timeout > 0, 0 <= --abandon <= 1")
    cfg = LoadConfig(
        ns.url.rstrip("/"),
        ns.sessions,
        ns.turns,
        ns.max_tokens,
        ns.timeout,
        ns.abandon,
        ns.duration,
        ns.seed,
    )
    return cfg, Path(ns.progress)


def main(argv: list[str] | None = None) -> int:
    cfg, path = parse_args(argv)
    return asyncio.run(main_async(cfg, path))


if __name__ == "__main__":
    sys.exit(main())
