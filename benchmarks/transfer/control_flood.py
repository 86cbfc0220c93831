"""Strangers flood a prefill worker's ZMQ control port while clients are served (LESSONS #18).

Starts `pdserve launch --prefill 1 --decode 1 --model builtin:tiny`, reads the prefill worker's
control address from its /info, then for --seconds (20) runs, all at once:
  * --flooders (2) processes sending 1-byte frames to the port as fast as ZMQ takes them,
    each a stranger (a DEALER with its own identity and no key);
  * one process sending --big-mib (200) MiB frames behind a well-formed-looking auth frame
    (the right size and magic, its own identity, a MAC of zeros) from one reused buffer;
  * with --multipart-mib N, one raw TCP connection speaking ZMTP 3.0 (NULL mechanism) that
    sends N 1-MiB frames all marked "more", so the message never ends: ZMQ keeps an
    unfinished message whole, below anything that reads the socket;
  * --clients (4) threads sending normal completions (8 tokens) through the router, one
    after the other each;
  * a sampler reading the prefill worker's /health and RSS (worker and engine process, if it
    has one) every 0.2 s.
It reports the client requests that failed (any error or non-200), the /health answers that
were not 200, P's RSS before, at its peak during and 5 s after the flood, and P's control
counters (frames dropped, by why). The cluster's control sockets take only members at ZMQ's
handshake (transfer/control_handshake.py: PLAIN by default, CURVE with --curve, which runs it
with PDSERVE_CONTROL_CURVE=1), so the flooders fail the handshake. Every process it starts
is stopped by its pid at the end, also when the run fails. Linux only (/proc).

  python benchmarks/transfer/control_flood.py [--seconds 20] [--curve] [--multipart-mib N] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.serving.launched import Pdserve  # noqa: E402
from pdserve.runtime.cluster_key import ClusterKey  # noqa: E402
from pdserve.transfer.control_handshake import CURVE_ENV  # noqa: E402

SAMPLE_S = 0.2
SETTLE_S = 5.0  # after the flood, before the last RSS reading
REQUEST_TIMEOUT_S = 30.0
STOP_S = 5.0  # a flooder gets this long to exit on SIGTERM, then SIGKILL


def flood(address: str, seconds: float, size: int) -> None:
    """One stranger: frames of `size` bytes to `address` for `seconds` (runs in a child)."""
    import zmq

    from pdserve.transfer.frame_auth import _HEAD, MAC_LEN, MAGIC

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    ident = f"stranger-{os.getpid()}".encode()
    s.setsockopt(zmq.IDENTITY, ident)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    if size <= 1:
        parts: list[Any] = [b"x"]
    else:  # looks signed: right size and magic, a fresh time, but a MAC of zeros
        head = _HEAD.pack(MAGIC, os.urandom(16), 1, time.time())
        parts = [head + bytes(MAC_LEN) + ident, zmq.Frame(bytes(size))]  # one buffer, reused
    sent = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            s.send_multipart(parts, zmq.NOBLOCK, copy=False)
            sent += 1
        except zmq.Again:
            time.sleep(0.001)  # ZMQ's queue to P is full: P is not reading
    print(json.dumps({"sent": sent}), flush=True)
    s.close(0)
    ctx.term()


def flood_multipart(address: str, seconds: float, mib: int) -> None:
    """A raw ZMTP 3.0 peer (NULL mechanism, a DEALER): `mib` 1-MiB frames of one endless
    message, then it holds the connection open until `seconds` have passed."""
    import socket
    import struct

    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    end = time.monotonic() + seconds
    sent = 0
    with socket.create_connection((host, int(port)), timeout=seconds) as s:
        greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
        s.sendall(greeting)
        got = b""
        while len(got) < 64:  # the server's greeting
            chunk = s.recv(64 - len(got))
            if not chunk:
                break
            got += chunk
        body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        frame = b"\x03" + struct.pack(">Q", 2**20) + bytes(2**20)  # more | long
        try:
            s.sendall(b"\x04" + bytes([len(body)]) + body)
            while sent < mib and time.monotonic() < end:
                s.sendall(frame)
                sent += 1
        except OSError:
            pass  # the server closed the connection (as it does a stranger under CURVE)
        time.sleep(max(0.0, end - time.monotonic()))
    print(json.dumps({"sent": sent}), flush=True)


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return round(total / 1024, 1)


def get_json(url: str, headers: dict[str, str] | None = None, timeout: float = 5.0) -> Any:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def health_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0  # no answer within 2 s


class Clients:
    """Threads each sending one completion after another until stopped."""

    def __init__(self, router: str, model: str, n: int) -> None:
        self.router, self.model = router, model
        self.ok: list[float] = []
        self.failed: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def _one(self) -> None:
        body = json.dumps(
            {"model": self.model, "prompt": "the quick brown fox", "max_tokens": 8}
        ).encode()
        req = urllib.request.Request(
            self.router + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        t = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                r.read()
            self.ok.append(time.monotonic() - t)
        except urllib.error.HTTPError as e:
            self.failed.append(f"{e.code} {e.read()[:200]!r}")
        except OSError as e:
            self.failed.append(f"{type(e).__name__}: {e}")

    def _run(self) -> None:
        while not self.stop.is_set():
            self._one()

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(REQUEST_TIMEOUT_S + 5)


def stop_flooders(procs: list[subprocess.Popen[str]]) -> None:
    """By each one's own handle (its pid): only the processes this run started."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(STOP_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(STOP_S)


def run(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    if args.curve:
        os.environ[CURVE_ENV] = "1"  # the launcher's children inherit it
    launch = ["launch", "--prefill", "1", "--decode", "1", "--model", args.model]
    with Pdserve(launch, log_dir) as cluster:
        table = json.loads((log_dir / "cluster.json").read_text())
        headers = ClusterKey.load(table["cluster_key_file"]).http_headers
        p_url = next(row["url"] for row in table["processes"] if row["name"].startswith("prefill"))
        info = get_json(p_url + "/info", headers)
        pids = [int(info["pid"])] + ([int(info["engine_pid"])] if info.get("engine_pid") else [])
        model = get_json(cluster.url + "/v1/models")["data"][0]["id"]
        before = rss_mib(pids)
        statuses: list[int] = []
        peak = before
        procs: list[subprocess.Popen[str]] = []
        cmd = [sys.executable, __file__, "--flood", info["control"], str(args.seconds)]
        try:
            with Clients(cluster.url, model, args.clients) as clients:
                for _ in range(args.flooders):
                    procs.append(subprocess.Popen([*cmd, "1"], stdout=subprocess.PIPE, text=True))
                if args.big_mib:
                    big = str(args.big_mib * 2**20)
                    procs.append(subprocess.Popen([*cmd, big], stdout=subprocess.PIPE, text=True))
                if args.multipart_mib:
                    more = [*cmd, str(args.multipart_mib), "multipart"]
                    procs.append(subprocess.Popen(more, stdout=subprocess.PIPE, text=True))
                end = time.monotonic() + args.seconds
                while time.monotonic() < end:
                    statuses.append(health_status(p_url))
                    peak = max(peak, rss_mib(pids))
                    time.sleep(SAMPLE_S)
            sent = [json.loads(p.communicate(timeout=30)[0] or "{}").get("sent") for p in procs]
        finally:
            stop_flooders(procs)
        time.sleep(SETTLE_S)
        after = rss_mib(pids)
        state = get_json(p_url + "/debug/state", headers)
        control = state["engine"]["role"]["control"]
        healthy_after = health_status(p_url)
    lat = sorted(clients.ok)
    return {
        "host": platform.node(),
        "cpus": len(os.sched_getaffinity(0)),
        "curve": args.curve,
        "seconds": args.seconds,
        "flooders_1_byte": args.flooders,
        "big_frame_mib": args.big_mib,
        "multipart_mib": args.multipart_mib,
        "frames_sent": sent,
        "requests_ok": len(lat),
        "requests_failed": len(clients.failed),
        "failures": clients.failed[:5],
        "latency_s_p50": round(statistics.median(lat), 3) if lat else None,
        "latency_s_max": round(lat[-1], 3) if lat else None,
        "health_samples": len(statuses),
        "health_not_200": sum(s != 200 for s in statuses),
        "health_after": healthy_after,
        "p_rss_mib": {"before": before, "peak": peak, "after": after},
        "p_rss_growth_mib": round(peak - before, 1),
        "p_control": {k: control.get(k) for k in ("dropped", "received", "sent")},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--flooders", type=int, default=2)
    ap.add_argument("--big-mib", type=int, default=200)
    ap.add_argument("--multipart-mib", type=int, default=0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--curve", action="store_true")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--flood", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.flood:  # ADDRESS SECONDS SIZE [multipart]
        address, seconds, size = args.flood[0], float(args.flood[1]), int(args.flood[2])
        if args.flood[3:] == ["multipart"]:
            flood_multipart(address, seconds, size)
        else:
            flood(address, seconds, size)
        return 0
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="control-flood-"))
    result = run(args, log_dir)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["requests_failed"] == 0 and result["health_not_200"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
