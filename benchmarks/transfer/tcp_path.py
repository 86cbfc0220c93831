"""The tcp data plane end to end: KV rooms from a prefill side to a decode side, two processes.

What a 1P+1D pair over `--backend tcp` does per room, with pdserve's own parts and nothing
else: P's `TcpWriter` posts the room's pages on the data-plane `Copier` thread (the copy out of
the pool, the pages' digests on the frame workers), P's `Control` signs and sends; D's
`Control` checks the message, D's `Stager` checks and stages the pages (with its frame
workers), and an engine-thread stand-in writes them into D's pool (`TcpReceiver.accept_rows`)
and answers with a Ping that names the room; beside it a thread stands in for D's decode
steps (`decode_steps`) and reports how late each woke: the time it waited for the GIL while
the path ran in its process. P keeps `--inflight` rooms in flight. Reported:
GB/s of KV, each process's CPU seconds per GB (user + system, all its threads), and a room's
round trip (its write posted to its answer; with `--inflight 1`, the path's latency).

The payload is a `--tokens` (256) prompt's KV of the llama3.2-1b shape (16 layers, 8 KV heads, head
dim 64, bfloat16, pages of 16 tokens: 16 pages of 512 KiB, 8 MiB a room), what issue 38's
serving runs move per request. Pools are on the CPU (pinned-memory staging and the GPU copies
are the GPU's part, not measured here).

`--trees new=.,base=/path/to/old/tree` measures several source trees side by side, runs
interleaved (new, base, new, base, ...); a tree from before the bulk frames (no
pdserve/transfer/stager.py) is driven the way its own decode worker ran: the frames, HMAC'd
on the control thread, copied into the pool by the engine thread (`receive_chunk`).
Usage: python benchmarks/transfer/tcp_path.py [--rooms 300] [--inflight 8] [--tokens 256]
       [--repeats 3] [--trees new=.,base=DIR] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import resource
import secrets
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 60.0  # the whole run's answers must come within this of each other
PAGE = 16
STEP_S = 0.002  # a decode step on the GPU at batch 128 (issue 38's H100 figures)
STEP_HOST_S = 0.0003  # its host work


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def import_tree(tree: str) -> None:
    sys.path.insert(0, tree)


def layout() -> Any:
    from pdserve.kvcache.layout import KVLayout

    return KVLayout.llama("bfloat16", page_size=PAGE, num_layers=16, num_kv_heads=8, head_dim=64)


def failed(peer: str, msg: object, why: str) -> None:
    raise RuntimeError(f"send of {type(msg).__name__} to {peer} failed: {why}")


def decode_side(tree: str, key_hex: str, address: str, pages: int) -> None:
    """D: take every chunk, stage it and write it into the pool, answer each with a Ping."""
    import_tree(tree)
    import torch

    from pdserve.kvcache.pool import KVPool
    from pdserve.kvcache.rank_pages import RankPages
    from pdserve.protocol.messages import KVChunk, Ping
    from pdserve.runtime.cluster_key import ClusterKey
    from pdserve.transfer.control import Control, Inbound

    torch.set_num_threads(1)
    pool = KVPool(layout(), pages, torch.device("cpu"))
    inbox: queue.Queue[Any] = queue.Queue()
    control = Control("d-bench", inbox.put, failed, ClusterKey(bytes.fromhex(key_hex)))
    threads: list[Any] = [control.tick]
    try:
        from pdserve.transfer.frame_workers import FrameWorkers, default_workers
        from pdserve.transfer.receiver import TcpReceiver
        from pdserve.transfer.stager import StagedChunk, Stager
    except ImportError:  # a tree before bulk frames: the engine thread copied the frames in
        from pdserve.transfer.dataplane import receive_chunk  # type: ignore[attr-defined]

        def take(cmd: Inbound) -> int:
            assert isinstance(cmd.msg, KVChunk)
            receive_chunk(RankPages.of(pool), cmd.msg.dst_pages, cmd.frames)  # type: ignore[attr-defined]
            return cmd.msg.room
    else:
        workers = FrameWorkers(default_workers())
        stager = Stager(inbox.put, pool.layout.page_bytes, False, workers)
        control.on_message = stager.put
        rx = TcpReceiver(RankPages.of(pool))
        threads += [stager.tick] + [workers.tick] * workers.workers

        def take(cmd: Any) -> int:
            assert isinstance(cmd, StagedChunk) and not cmd.refused, cmd
            rx.accept_rows(cmd.msg.room, cmd.msg.epoch, cmd.msg.dst_pages, cmd.rows)
            return cmd.msg.room

    stop = threading.Event()
    for tick in threads:
        threading.Thread(target=lambda t=tick: [t() for _ in iter(stop.is_set, True)],
                         daemon=True).start()  # fmt: skip
    late: list[float] = []
    steps = threading.Thread(target=decode_steps, args=(stop, late), daemon=True)
    control.send(address, Ping(nonce=0))  # hello: P learns our identity
    before = cpu_s()
    steps.start()
    while True:
        cmd = inbox.get(timeout=WAIT_S)
        if isinstance(cmd, Inbound) and isinstance(cmd.msg, Ping):  # P: done
            break
        control.send(address, Ping(nonce=take(cmd)))
    d_cpu = cpu_s() - before
    stop.set()
    steps.join(timeout=WAIT_S)
    late = sorted(late[:]) or [0.0]  # a copy: a thread that outlived its join still appends
    at = [late[min(len(late) - 1, int(q * len(late)))] * 1e3 for q in (0.5, 0.9, 0.99)]
    print(json.dumps({"d_cpu_s": d_cpu, "step_late_ms": [round(x, 3) for x in at]}), flush=True)


def decode_steps(stop: threading.Event, late: list[float]) -> None:
    """D's engine as the GIL sees it: a GPU step of STEP_S (the thread holds no GIL, as in
    `wait_event`), then STEP_HOST_S of Python. Each step's wake-up lateness is the time it
    waited for the GIL (and, on a machine with few cores, for a core)."""
    while not stop.is_set():
        t = time.perf_counter()
        time.sleep(STEP_S)
        woke = time.perf_counter()
        late.append(woke - t - STEP_S)
        while time.perf_counter() - woke < STEP_HOST_S:
            pass


def prefill_side(tree: str, rooms: int, inflight: int, tokens: int) -> dict[str, Any]:
    import_tree(tree)
    import torch

    from pdserve.kvcache.pool import KVPool
    from pdserve.kvcache.rank_pages import RankPages
    from pdserve.protocol.messages import Ping
    from pdserve.runtime.cluster_key import ClusterKey
    from pdserve.transfer.control import Control, Inbound
    from pdserve.transfer.copier import Copier
    from pdserve.transfer.dataplane import TcpWriter

    torch.set_num_threads(1)
    lay = layout()
    per_room = tokens // PAGE
    pages = per_room * inflight
    pool = KVPool(lay, pages, torch.device("cpu"))
    pool.data.copy_(torch.randint(0, 256, pool.data.shape, dtype=torch.uint8))
    key_hex = secrets.token_hex(32)
    acks: queue.Queue[int] = queue.Queue()
    peer: list[str] = []

    def on_message(inbound: Inbound) -> None:
        peer.append(inbound.peer)
        if isinstance(inbound.msg, Ping) and inbound.msg.nonce:
            acks.put(inbound.msg.nonce)

    control = Control("p-bench", on_message, failed, ClusterKey(bytes.fromhex(key_hex)))
    address = control.bind("127.0.0.1", 0)
    try:
        from pdserve.transfer.frame_workers import FrameWorkers, default_workers
    except ImportError:
        copier = Copier()
        workers = None
    else:
        workers = FrameWorkers(default_workers())
        copier = Copier(workers)  # type: ignore[call-arg]
    stop = threading.Event()
    ticks = [control.tick, copier.tick] + ([workers.tick] * workers.workers if workers else [])
    for tick in ticks:
        threading.Thread(target=lambda t=tick: [t() for _ in iter(stop.is_set, True)],
                         daemon=True).start()  # fmt: skip
    d = subprocess.Popen(
        [sys.executable, __file__, "--decode", tree, key_hex, address, str(pages)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + WAIT_S
        while not peer:
            if time.monotonic() > deadline or d.poll() is not None:
                raise SystemExit("the decode side did not say hello")
            time.sleep(0.01)
        writer = TcpWriter(control, peer[0], "p-bench", copier)
        src = RankPages.of(pool)
        posted = 0

        sent_at: dict[int, float] = {}
        took: list[float] = []

        def post(slot: int) -> None:
            nonlocal posted
            posted += 1
            span = list(range(slot * per_room, (slot + 1) * per_room))
            sent_at[posted] = time.perf_counter()
            writer.write(posted, 1, src, span, span, time.monotonic() + WAIT_S)

        before, t0 = cpu_s(), time.perf_counter()
        for slot in range(min(inflight, rooms)):
            post(slot)
        for _ in range(rooms):
            room = acks.get(timeout=WAIT_S)
            took.append(time.perf_counter() - sent_at.pop(room))
            if posted < rooms:
                post((room - 1) % inflight)
        wall = time.perf_counter() - t0
        p_cpu = cpu_s() - before
        control.send(peer[0], Ping(nonce=0))  # done
        out, _ = d.communicate(timeout=WAIT_S)
    finally:
        stop.set()
        if d.poll() is None:
            d.kill()  # by its own handle: only the process this run started
            d.wait(5.0)
    gb = rooms * per_room * lay.page_bytes / 1e9
    d_said = json.loads(out.strip().splitlines()[-1])
    return {
        "GBps": round(gb / wall, 3),
        "p_cpu_s_per_GB": round(p_cpu / gb, 3),
        "d_cpu_s_per_GB": round(d_said["d_cpu_s"] / gb, 3),
        "d_step_late_ms_p50_p90_p99": d_said["step_late_ms"],
        "room_ms_p50": round(statistics.median(took) * 1e3, 3),
        "wall_s": round(wall, 3),
    }


def median_of(values: list[Any]) -> Any:
    """The median of numbers, or of lists of numbers position by position."""
    if isinstance(values[0], list):
        return [statistics.median(col) for col in zip(*values, strict=True)]
    return statistics.median(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rooms", type=int, default=300)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256, help="a room's prompt (pages of 16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trees", default=f"new={ROOT}")
    ap.add_argument("--out", default=None)
    ap.add_argument("--decode", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--prefill", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.decode:
        return decode_side(args.decode[0], args.decode[1], args.decode[2], int(args.decode[3]))
    if args.prefill:
        result = prefill_side(args.prefill, args.rooms, args.inflight, args.tokens)
        print(json.dumps(result), flush=True)
        return
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            cmd = [sys.executable, __file__, "--prefill", str(Path(tree).resolve()),
                   "--rooms", str(args.rooms), "--inflight", str(args.inflight),
                   "--tokens", str(args.tokens)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(name, runs[name][-1], flush=True)
    result: dict[str, Any] = {
        "host": platform.node(),
        "cpus": len(os.sched_getaffinity(0)),
        "rooms": args.rooms,
        "inflight": args.inflight,
        "bytes_per_room": args.tokens * 32 * 1024,
        "runs": runs,
        "median": {
            name: {k: median_of([r[k] for r in rs]) for k in rs[0]} for name, rs in runs.items()
        },
    }
    names = list(trees)
    if len(names) > 1:
        first = names[0]
        result["GBps_ratio_to_" + names[1]] = round(
            statistics.median(
                a["GBps"] / b["GBps"] for a, b in zip(runs[first], runs[names[1]], strict=True)
            ),
            3,
        )
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
