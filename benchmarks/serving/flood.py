"""Floods against a real co-located server: memory, descriptors and latency stay bounded.

Starts its own `pdserve serve --model builtin:tiny --port 0` (default limits: idle 5 s, request
head 10 s, 8192 connections), then runs, one after the other:

  idle-streams   500 streaming completions (16 tokens each) opened at once and never read
                 nor closed; "during" is measured once the server has generated them all and
                 holds the 500 unread answers (the latency while it still generates them, its
                 8,000 tokens queued ahead of the normal request, is in the notes);
  slowloris      200 connections each sending a request head one header line a second,
                 never finishing it;
  connect-drop   10,000 connections opened and dropped at once (every other one with an RST),
                 200 at a time.

For each flood it records the server's RSS and open descriptors before, at their peak during
(sampled every 0.1 s), while the flood's clients still hold their connections but after the
server's timeouts could act (`held`: 6 s after the streams' answers, 12 s into the slowloris
heads), and after (the flood's connections released, the server left 6 s); the latency of a
normal completion (8 tokens) once the flood is established and again after; the lines the
server logged; and the listener's counters from /debug/state. A normal request must be
answered within 2 s (`ok`). Prints a table; --out writes the whole record as JSON. Linux
only (/proc).

  python benchmarks/serving/flood.py [--model builtin:tiny] [--out flood.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
NORMAL_BUDGET_S = 2.0
SETTLE_S = 6.0  # after a flood: longer than the server's idle timeout (5 s)
MIB = 1 << 20


@dataclass
class Sample:
    rss_mib: float
    fds: int


@dataclass
class FloodResult:
    name: str
    connections: int
    before: Sample
    peak: Sample
    held: Sample
    after: Sample
    normal_during_s: float | None
    normal_after_s: float | None
    log_lines: int
    flood_s: float
    server_counters: dict[str, Any] = field(default_factory=dict)
    notes: str = ""

    @property
    def ok(self) -> bool:
        times = (self.normal_during_s, self.normal_after_s)
        return all(t is not None and t <= NORMAL_BUDGET_S for t in times)


# -- the server -------------------------------------------------------------------------------
class Server:
    def __init__(self, model: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_KEY_FILE"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "serve", "--model", model, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self.lines: list[str] = []
        self.url = ""
        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("READY "):
                    self.url = line.split()[1]
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + 300
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit("the server did not start:\n" + "".join(self.lines[-30:]))
        host, port = self.url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)

    def sample(self) -> Sample:
        pid = self.proc.pid
        rss = 0.0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024 / MIB
        return Sample(round(rss, 1), len(os.listdir(f"/proc/{pid}/fd")))

    def state(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(self.url + "/debug/state", timeout=5) as r:
                return dict(json.loads(r.read()))
        except OSError as e:
            return {"error": str(e)}

    def counters(self) -> dict[str, Any]:
        return dict(self.state().get("http") or {})

    def wait_engine_idle(self, timeout_s: float = 120.0) -> float:
        """Seconds until the engine holds no request (bounded)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            engine = self.state().get("engine") or {}
            if not engine.get("requests", True):
                break
            time.sleep(0.05)
        return round(time.monotonic() - t0, 2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# -- clients ----------------------------------------------------------------------------------
def completion_request(body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: flood\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def normal_request(url: str) -> float | None:
    """Seconds to answer a normal 8-token completion; None if it failed or took over 30 s."""
    body = json.dumps({"prompt": "The weather today", "max_tokens": 8}).encode()
    req = urllib.request.Request(
        url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            ok = r.status == 200 and json.loads(r.read())["choices"][0]["finish_reason"]
    except (OSError, ValueError, KeyError):
        return None
    return round(time.perf_counter() - t0, 3) if ok else None


async def sampler(server: Server, stop: asyncio.Event, peak: list[Sample]) -> None:
    while not stop.is_set():
        s = server.sample()
        peak[0] = Sample(max(peak[0].rss_mib, s.rss_mib), max(peak[0].fds, s.fds))
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except TimeoutError:
            pass


Release = Callable[[], Awaitable[None]]
held: list[Sample] = []  # what a flood's release() saw while its clients still held on


async def idle_streams(server: Server, n: int = 500) -> tuple[Release, str]:
    """Open n streams that are never read; returns how to release them."""
    req = completion_request(
        {"prompt": "flood", "max_tokens": 16, "stream": True, "ignore_eos": True}
    )
    conns = []
    for _ in range(n):
        _, w = await asyncio.open_connection(server.host, server.port)
        w.transport.set_write_buffer_limits(0)
        w.transport.pause_reading()  # never read the answer
        w.write(req)
        conns.append(w)
    await asyncio.sleep(0.5)
    generating = await asyncio.to_thread(normal_request, server.url)
    idle_after = await asyncio.to_thread(server.wait_engine_idle)

    async def release() -> None:
        await asyncio.sleep(SETTLE_S)  # held past the server's idle timeout
        held.append(server.sample())
        for w in conns:
            w.transport.abort()

    return release, (
        f"{n} streams of 16 tokens, never read; a normal request while they were being "
        f"generated: {generating}s; all generated {idle_after}s after that"
    )


async def slowloris(server: Server, n: int = 200) -> tuple[Release, str]:
    """n connections sending one header line a second, forever; returns how to stop them."""
    writers = []
    for _ in range(n):
        _, w = await asyncio.open_connection(server.host, server.port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: flood\r\n")
        writers.append(w)
    stop = asyncio.Event()
    closed = [0]

    async def trickle(w: asyncio.StreamWriter) -> None:
        i = 0
        while not stop.is_set() and not w.is_closing():
            try:
                w.write(f"X-Slow-{i}: a\r\n".encode())
                await w.drain()
            except ConnectionError:
                closed[0] += 1
                return
            i += 1
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass

    tasks = [asyncio.ensure_future(trickle(w)) for w in writers]
    await asyncio.sleep(2.0)

    async def release() -> None:
        await asyncio.sleep(10.0)  # 12 s in: past the head timeout (10 s)
        held.append(server.sample())
        stop.set()
        await asyncio.gather(*tasks)
        for w in writers:
            w.transport.abort()

    return release, f"{n} heads, one header line a second"


async def connect_drop(server: Server, n: int = 10_000, at_once: int = 200) -> tuple[Release, str]:
    """n connections opened and dropped at once, `at_once` in flight; every other one RST."""
    failures = [0]

    def one(i: int) -> None:
        s = socket.socket()
        try:
            s.connect((server.host, server.port))
            if i % 2:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            failures[0] += 1
        finally:
            s.close()

    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    async def storm() -> None:
        for start in range(0, n, at_once):
            await asyncio.gather(
                *(loop.run_in_executor(None, one, i) for i in range(start, start + at_once))
            )
        done.set()

    task = asyncio.ensure_future(storm())
    await asyncio.sleep(1.0)  # well into the storm

    async def release() -> None:
        await task
        held.append(server.sample())  # every connection dropped by its client already
        if failures[0]:
            print(f"  connect-drop: {failures[0]} connects failed", file=sys.stderr)

    return release, f"{n} connects, {at_once} at a time, half closed with RST"


async def run_flood(
    server: Server,
    name: str,
    start: Callable[[Server], Awaitable[tuple[Release, str]]],
    connections: int,
) -> FloodResult:
    before = server.sample()
    lines0 = len(server.lines)
    peak = [before]
    stop_sampling = asyncio.Event()
    sampling = asyncio.ensure_future(sampler(server, stop_sampling, peak))
    t0 = time.perf_counter()
    held.clear()
    release, notes = await start(server)
    during = await asyncio.to_thread(normal_request, server.url)
    await release()
    flood_s = time.perf_counter() - t0
    await asyncio.sleep(SETTLE_S)
    stop_sampling.set()
    await sampling
    after = server.sample()
    after_s = await asyncio.to_thread(normal_request, server.url)
    return FloodResult(
        name,
        connections,
        before,
        peak[0],
        held[0],
        after,
        during,
        after_s,
        len(server.lines) - lines0,
        round(flood_s, 1),
        server.counters(),
        notes,
    )


def table(results: list[FloodResult]) -> str:
    rows = [
        "| flood | RSS MiB before / peak / after | fds before / peak / held / after "
        "| normal request during / after (s) | log lines | ok |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r.name} ({r.connections:,}) "
            f"| {r.before.rss_mib:.0f} / {r.peak.rss_mib:.0f} / {r.after.rss_mib:.0f} "
            f"| {r.before.fds} / {r.peak.fds} / {r.held.fds} / {r.after.fds} "
            f"| {r.normal_during_s} / {r.normal_after_s} | {r.log_lines} "
            f"| {'yes' if r.ok else 'NO'} |"
        )
    return "\n".join(rows)


async def main_async(server: Server) -> list[FloodResult]:
    baseline = await asyncio.to_thread(normal_request, server.url)  # warm up
    print(f"normal request before any flood: {baseline}s", file=sys.stderr)
    out = []
    for name, start, n in (
        ("idle-streams", idle_streams, 500),
        ("slowloris", slowloris, 200),
        ("connect-drop", connect_drop, 10_000),
    ):
        print(f"running {name} ...", file=sys.stderr)
        out.append(await run_flood(server, name, start, n))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--out", default=None, help="write the record as JSON here")
    args = p.parse_args()
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # 500 streams + 200 heads
    server = Server(args.model)
    try:
        results = asyncio.run(main_async(server))
        final = server.sample()
    finally:
        server.stop()
    print(table(results))
    ok = all(r.ok for r in results)
    record = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "model": args.model,
        "normal_budget_s": NORMAL_BUDGET_S,
        "floods": [{**asdict(r), "ok": r.ok} for r in results],
        "server_at_end": asdict(final),
        "ok": ok,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
