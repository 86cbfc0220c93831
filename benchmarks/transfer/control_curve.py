"""What ZMQ CURVE costs the tcp data plane: KV pages through two real Controls, plain vs CURVE.

The tcp backend sends a room's KV as one `KVChunk` message plus a frame per page over the
control sockets (transfer/dataplane.py, TcpWriter), so CURVE (transfer/control_handshake.py)
encrypts every page. Here a prefill side (this process) sends a 2,048-token prompt's KV of
the qwen2-0.5b shape (128 pages of 192 KiB, 24 MiB, as benchmarks/transfer/transfer.py) to a decode
side in another process, which checks and stages the pages (`Stager`) and writes them into its
pool (`TcpReceiver.accept_rows`) and answers;
one write is that round trip. Each mode has its own pair of Controls, ticked by their own
threads as in a worker; calls alternate between the two modes, and the ratio is the median of
per-pair ratios.
Usage: python benchmarks/transfer/control_curve.py [--iters 30] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import platform
import secrets
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pdserve.kvcache.layout import KVLayout  # noqa: E402
from pdserve.kvcache.pool import KVPool  # noqa: E402
from pdserve.kvcache.rank_pages import RankPages  # noqa: E402
from pdserve.protocol.messages import KVChunk, Msg, Ping  # noqa: E402
from pdserve.runtime.cluster_key import ClusterKey  # noqa: E402
from pdserve.transfer.bulk import Bulk  # noqa: E402
from pdserve.transfer.control import Control, Inbound  # noqa: E402
from pdserve.transfer.control_handshake import Handshake  # noqa: E402
from pdserve.transfer.receiver import TcpReceiver  # noqa: E402
from pdserve.transfer.stager import StagedChunk, Stager  # noqa: E402

LAYOUT = KVLayout.llama("bfloat16", page_size=16, num_layers=24, num_kv_heads=2, head_dim=64)
MODES = {"plain": Handshake.PLAIN, "curve": Handshake.CURVE}
WAIT_S = 30.0  # one write's round trip may take at most this


def spin(controls: list[Control], stop: threading.Event) -> list[threading.Thread]:
    def loop(c: Control) -> None:
        while not stop.is_set():
            c.tick()

    threads = [threading.Thread(target=loop, args=(c,), daemon=True) for c in controls]
    for t in threads:
        t.start()
    return threads


def failed(peer: str, msg: Msg, why: str) -> None:
    raise RuntimeError(f"send of {type(msg).__name__} to {peer} failed: {why}")


def decode_side(key_hex: str, addresses: dict[str, str], pages: int) -> None:
    """Connect to each prefill side, say hello, copy every chunk in and answer with a Ping."""
    key = ClusterKey(bytes.fromhex(key_hex))
    pool = KVPool(LAYOUT, pages, torch.device("cpu"))
    rx = TcpReceiver(RankPages.of(pool))
    controls: dict[str, Control] = {}
    stagers: list[Stager] = []
    for mode, hs in MODES.items():

        def on_staged(staged: object, mode: str = mode) -> None:  # the stager's thread
            if isinstance(staged, StagedChunk):
                msg = staged.msg
                rx.accept_rows(msg.room, msg.epoch, msg.dst_pages, staged.rows)
                controls[mode].send(staged.peer, Ping(nonce=msg.room))

        stager = Stager(on_staged, LAYOUT.page_bytes, pin=False)
        stagers.append(stager)
        controls[mode] = Control(f"d-{mode}", stager.put, failed, key, handshake=hs)
    stop = threading.Event()
    spin(list(controls.values()), stop)
    for stager in stagers:
        threading.Thread(target=lambda s=stager: [s.tick() for _ in iter(stop.is_set, True)],
                         daemon=True).start()  # fmt: skip
    for mode, c in controls.items():
        c.send(addresses[mode], Ping(nonce=0))
    sys.stdin.readline()  # the prefill side closes it when done
    stop.set()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", default=None)
    ap.add_argument("--decode", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    pages = args.tokens // LAYOUT.page_size
    if args.decode:
        return decode_side(args.decode[0], json.loads(args.decode[1]), int(args.decode[2]))
    key_hex = secrets.token_hex(32)
    key = ClusterKey(bytes.fromhex(key_hex))
    acks: dict[str, threading.Semaphore] = {mode: threading.Semaphore(0) for mode in MODES}
    peers: dict[str, str] = {}

    def on_message(mode: str, inbound: Inbound) -> None:
        peers[mode] = inbound.peer
        if isinstance(inbound.msg, Ping) and inbound.msg.nonce:
            acks[mode].release()

    controls = {
        mode: Control(f"p-{mode}", lambda i, m=mode: on_message(m, i), failed, key, handshake=hs)
        for mode, hs in MODES.items()
    }
    addresses = {mode: c.bind("127.0.0.1", 0) for mode, c in controls.items()}
    stop = threading.Event()
    threads = spin(list(controls.values()), stop)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (pages, LAYOUT.page_bytes), dtype=torch.uint8, generator=g)
    decode = subprocess.Popen(
        [sys.executable, __file__, "--decode", key_hex, json.dumps(addresses), str(pages)],
        stdin=subprocess.PIPE,
    )
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        deadline = time.monotonic() + WAIT_S
        while len(peers) < len(MODES):
            if time.monotonic() > deadline or decode.poll() is not None:
                raise SystemExit("the decode side did not say hello")
            time.sleep(0.01)
        for i in range(1, args.iters + 2):  # the first round warms up and is not counted
            for mode, c in controls.items():
                t = time.perf_counter()
                bulk = Bulk.seal([memoryview(row) for row in src.clone().numpy()])  # as TcpWriter
                c.send(peers[mode], KVChunk(room=i, dst_pages=list(range(pages))), bulk)
                if not acks[mode].acquire(timeout=WAIT_S):
                    raise SystemExit(f"{mode}: write {i} was not answered in {WAIT_S} s")
                if i > 1:
                    times[mode].append(time.perf_counter() - t)
    finally:
        stop.set()
        for t in threads:
            t.join(1.0)
        if decode.stdin is not None:
            decode.stdin.close()
        try:
            decode.wait(5.0)
        except subprocess.TimeoutExpired:
            decode.kill()  # by its own handle: only the process this run started
            decode.wait(5.0)
        for c in controls.values():
            c.close()
    nbytes = pages * LAYOUT.page_bytes
    result: dict[str, object] = {
        "host": platform.node(),
        "cpus": len(__import__("os").sched_getaffinity(0)),
        "bytes_per_write": nbytes,
        "iters": args.iters,
    }
    for mode, ts in times.items():
        med = statistics.median(ts)
        result[f"{mode}_ms_p50"] = round(med * 1e3, 2)
        result[f"{mode}_GBps_p50"] = round(nbytes / med / 1e9, 3)
    pairs = zip(times["curve"], times["plain"], strict=True)
    result["curve_over_plain_time_p50"] = round(statistics.median(c / p for c, p in pairs), 3)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
