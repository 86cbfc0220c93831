"""KV transfer speed: pdserve's nixl backend vs a raw NIXL WRITE vs memcpy, in one run.

The payload is a 2,048-token prompt's KV of the qwen2-0.5b shape (24 layers, 2 KV heads,
head dim 64, bfloat16, pages of 16 tokens: 24 MiB). Measured side by side:
  * pdserve nixl — `NixlWriter.write` of 128 scattered source pages into 128 scattered
    destination pages of a decode pool in another process (one 192 KiB run per page: the
    pool keeps a page of every layer together), waited to completion as the engine polls it;
  * raw NIXL — one WRITE of the same number of bytes, contiguous to contiguous, between the
    same two agents (the best NIXL can do here);
  * memcpy — torch copy of the same bytes within this process (contiguous), and pdserve's
    shm backend (scattered pages into a /dev/shm pool, what `--backend shm` does).
With `--device cuda` both pools, the raw regions and the memcpy live in GPU memory (NIXL
registers them as VRAM; the shm backend is CPU-only and is left out).
Usage: python benchmarks/transfer.py [--tokens 2048] [--iters 30] [--device cpu|cuda] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.kvcache.layout import KVLayout  # noqa: E402
from pdserve.kvcache.pool import KVPool  # noqa: E402
from pdserve.protocol.messages import NixlPool  # noqa: E402
from pdserve.runtime.timing import ROLE_POLL_S  # noqa: E402
from pdserve.transfer.dataplane import ShmWriter  # noqa: E402
from pdserve.transfer.nixl import NixlAgent, NixlWriter  # noqa: E402

LAYOUT = KVLayout.llama("bfloat16", page_size=16, num_layers=24, num_kv_heads=2, head_dim=64)


def peer_main(num_pages: int, raw_bytes: int, device: str) -> None:
    """The decode side: a pool and a contiguous region, both registered; answers on stdin."""
    pool = KVPool(LAYOUT, num_pages, torch.device(device))
    agent = NixlAgent(f"bench-d-{os.getpid()}", pool)
    raw = torch.zeros(raw_bytes, dtype=torch.uint8, device=device)
    agent.agent.register_memory(raw)
    d = agent.descriptor()
    print(
        "PEER "
        + json.dumps({"md": d.agent_md.hex(), "base": d.base, "raw": raw.data_ptr(), "mem": d.mem}),
        flush=True,
    )
    while True:
        # Like a decode engine with rooms open: drain notifications (which drives UCX) every
        # ROLE_POLL_S, between commands.
        agent.landed()
        if not select.select([sys.stdin], [], [], ROLE_POLL_S)[0]:
            continue
        line = sys.stdin.readline()
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "quit" or not line:  # quit, or the benchmark went away (EOF)
            return
        if cmd == "check":  # a checksum of the given pages' bytes, for the write check
            print(f"PEER {checksum(pool, json.loads(arg))}", flush=True)


def checksum(pool: KVPool, pages: list[int]) -> int:
    return sum(int(pool.page(p).long().sum()) for p in pages)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--peer", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        return peer_main(*args.peer, args.device)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    pages = args.tokens // LAYOUT.page_size
    pool_pages = 4 * pages
    nbytes = pages * LAYOUT.page_bytes
    g = torch.Generator().manual_seed(args.seed)
    src_pages = torch.randperm(pool_pages, generator=g)[:pages].tolist()
    dst_pages = torch.randperm(pool_pages, generator=g)[:pages].tolist()

    peer = subprocess.Popen(
        [sys.executable, __file__, "--peer", str(pool_pages), str(nbytes), "--device", args.device],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdout is not None and peer.stdin is not None
        line = ""
        while not line.startswith("PEER "):
            line = peer.stdout.readline()
            if not line:
                raise SystemExit("the decode-side peer exited before it was ready")
        info = json.loads(line[5:])
        src = KVPool(LAYOUT, pool_pages, dev)
        src.data.copy_(torch.randint(0, 256, tuple(src.data.shape), dtype=torch.uint8, generator=g))
        agent = NixlAgent(f"bench-p-{os.getpid()}", src)
        remote = NixlPool(bytes.fromhex(info["md"]), info["base"], 0, info["mem"])
        mem = info["mem"]
        writer = NixlWriter(agent, remote, LAYOUT, pool_pages)

        def pdserve_nixl() -> None:
            x = writer.write(1, 1, src, src_pages, dst_pages, time.monotonic() + 30)
            while not x.poll():
                time.sleep(ROLE_POLL_S)  # the idle engine's polling period

        raw_src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=g).to(dev)
        agent.agent.register_memory(raw_src)
        local = agent.agent.get_xfer_descs([(raw_src.data_ptr(), nbytes, 0)], mem)
        far = agent.agent.get_xfer_descs([(info["raw"], nbytes, 0)], mem)
        handle = agent.agent.initialize_xfer("WRITE", local, far, writer.remote_name, b"raw")

        def raw_nixl() -> None:
            state = agent.agent.transfer(handle)
            while state == "PROC":
                time.sleep(ROLE_POLL_S)  # polled like pdserve's, so only the transfer differs
                state = agent.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL write ended {state}")

        # Real bytes: an untouched torch.empty maps the zero page, and copying it is cache-fast.
        a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=g).to(dev)
        b = torch.empty(nbytes, dtype=torch.uint8, device=dev)

        def memcpy() -> None:
            b.copy_(a)
            sync()

        methods = [
            ("pdserve_nixl_scattered", pdserve_nixl),
            ("raw_nixl_contiguous", raw_nixl),
            ("memcpy_contiguous", memcpy),
        ]
        if dev.type == "cpu":
            shm_dst = KVPool(LAYOUT, pool_pages, dev, shared=True)
            assert shm_dst.shm is not None
            shm = ShmWriter(shm_dst.shm, LAYOUT, pool_pages)
            methods.append(
                ("pdserve_shm_scattered", lambda: shm.write(1, 1, src, src_pages, dst_pages, 0))
            )

        for _, fn in methods:
            fn()  # warm-up: connection, registration caches
        results: dict[str, list[float]] = {name: [] for name, _ in methods}
        # Interleave the methods call by call, so that a noisy neighbour or a drifting clock
        # hits all alike; the ratio is then taken per pair of neighbouring calls.
        for i in range(args.iters):
            for name, fn in methods if i % 2 == 0 else methods[::-1]:  # no fixed order bias
                results[name].append(timed(fn))
        # The bytes really landed (checked once, outside the timing).
        src.page(src_pages[0]).fill_(0xA5)  # so that a stale copy cannot pass
        pdserve_nixl()
        peer.stdin.write(f"check {json.dumps(dst_pages)}\n")
        peer.stdin.flush()
        line = peer.stdout.readline()
        while not line.startswith("PEER "):
            line = peer.stdout.readline()
        if int(line[5:]) != checksum(src, src_pages):
            raise SystemExit("pdserve nixl write: the destination pages differ from the source")
        handle.release()
        peer.stdin.write("quit\n")
        peer.stdin.flush()
    finally:
        if peer.poll() is None:
            peer.kill()
        peer.wait(10)

    med = {k: statistics.median(v) for k, v in results.items()}
    gbps = {k: nbytes / t / 1e9 for k, t in med.items()}
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs",
        "command": "python " + " ".join([sys.argv[0], *sys.argv[1:]]),
        "payload": {
            "tokens": args.tokens,
            "bytes": nbytes,
            "pages": pages,
            "descriptors_per_write": pages,
            "descriptor_bytes": LAYOUT.page_bytes,
        },
        "median_s": {k: round(v, 6) for k, v in med.items()},
        "GB_per_s": {k: round(v, 3) for k, v in gbps.items()},
        "pdserve_nixl_vs_raw_nixl": round(
            gbps["pdserve_nixl_scattered"] / gbps["raw_nixl_contiguous"], 3
        ),
        # The same ratio call by call (raw time / pdserve time of neighbouring calls): the
        # median of these is steadier than the ratio of medians on a busy machine.
        "pdserve_nixl_vs_raw_nixl_paired": round(
            statistics.median(
                r / p
                for p, r in zip(
                    results["pdserve_nixl_scattered"], results["raw_nixl_contiguous"], strict=True
                )
            ),
            3,
        ),
        "pdserve_nixl_vs_memcpy": round(
            gbps["pdserve_nixl_scattered"] / gbps["memcpy_contiguous"], 3
        ),
        "device": args.device,
        "UCX_TLS": os.environ.get("UCX_TLS", "(UCX default)"),
    }
    print(json.dumps(doc, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
