"""KV transfer speed: pdserve's nixl backend vs raw NIXL vs memcpy, in one run.

The payload is a 2,048-token prompt's KV of the qwen2-0.5b shape (24 layers, 2 KV heads,
head dim 64, bfloat16, pages of 16 tokens: 128 pages of 192 KiB, 24 MiB), written from a
prefill pool in this process into a decode pool in another process. A write costs its bytes
plus one UCX operation per descriptor, and NIXL merges pages consecutive on *both* sides into
one descriptor, so each page pattern is measured three ways, side by side:
  * pdserve_<pattern> — `NixlWriter.write` of those pages, polled to completion like the
    engine polls it (make the request, post, poll, release: everything pdserve does);
  * raw_descs_<pattern> — raw NIXL posting exactly the rows pdserve posts for those pages
    (the same prepared lists, indices and notification), its request made once and reposted:
    the cost of the pattern without pdserve;
  * raw_nixl_contiguous — one WRITE of the same bytes as one region (one descriptor), the
    best NIXL can do here; memcpy (a torch copy in one process) and, on the CPU, pdserve's
    shm backend (scattered pages into a /dev/shm pool).
Patterns (source pages on P, destination pages on D):
  * scattered — random pages on both sides (what the old FIFO allocator handed out once its
    free list was shuffled): one descriptor per page;
  * dst_contiguous — random source pages into consecutive destination pages (a fresh D, a
    busy P): still one descriptor per page, as both sides must be consecutive to merge;
  * contiguous — consecutive on both sides (fresh or quiet pools): one descriptor;
  * churned — what `PageAllocator` hands out on each side after a simulated serving churn
    (requests of 1-64 pages start, grow by a page and finish at random): a few descriptors.
Ratios are medians of per-call-pair ratios (calls are interleaved). pdserve / raw_descs is
pdserve's own overhead; raw_descs / raw_nixl_contiguous is what the page pattern costs.
With `--device cuda` all pools and regions live in GPU memory (NIXL registers them as VRAM;
shm is left out). `--poll-s 0` polls without sleeping (the transfer alone); the default is the
engine's polling period while a transfer is open (ROLE_POLL_S).
Usage: python benchmarks/transfer/transfer.py [--tokens 2048] [--iters 30] [--device cpu|cuda]
       [--poll-s S] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pdserve.kvcache.allocator import PageAllocator  # noqa: E402
from pdserve.kvcache.layout import KVLayout  # noqa: E402
from pdserve.kvcache.pool import KVPool  # noqa: E402
from pdserve.protocol.messages import NixlPool  # noqa: E402
from pdserve.runtime.timing import ROLE_POLL_S  # noqa: E402
from pdserve.transfer.dataplane import ShmWriter  # noqa: E402
from pdserve.transfer.nixl import NixlAgent, NixlWriter, notif, page_spans, run_indices  # noqa: E402

LAYOUT = KVLayout.llama("bfloat16", page_size=16, num_layers=24, num_kv_heads=2, head_dim=64)
PATTERNS = ("scattered", "dst_contiguous", "contiguous", "churned")


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


def churned_pages(num_pages: int, need: int, seed: int, steps: int = 3000) -> list[int]:
    """The pages `PageAllocator` hands a request of `need` pages after a serving churn."""
    rng = random.Random(seed)
    alloc = PageAllocator(num_pages)
    live: list[list[int]] = []
    for _ in range(steps):
        if live and (rng.random() < 0.45 or not alloc.can_allocate(64)):
            alloc.release(live.pop(rng.randrange(len(live))))  # a request finished
        else:
            live.append(alloc.allocate(rng.randint(1, 64)))  # a request started
        if live and alloc.can_allocate(1):
            rng.choice(live).extend(alloc.allocate(1))  # a decoding request grew by a page
    while not alloc.can_allocate(need):
        alloc.release(live.pop(rng.randrange(len(live))))
    return alloc.allocate(need)


def page_patterns(pages: int, pool_pages: int, seed: int) -> dict[str, tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    src_rand = torch.randperm(pool_pages, generator=g)[:pages].tolist()
    dst_rand = torch.randperm(pool_pages, generator=g)[:pages].tolist()
    run = list(range(pages, 2 * pages))
    return {
        "scattered": (src_rand, dst_rand),
        "dst_contiguous": (src_rand, run),
        "contiguous": (run, list(range(2 * pages, 3 * pages))),
        "churned": (
            churned_pages(pool_pages, pages, seed + 1),
            churned_pages(pool_pages, pages, seed + 2),
        ),
    }


def timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def paired(results: dict[str, list[float]], num: str, den: str) -> float:
    """Median over neighbouring calls of rate(num) / rate(den) = time(den) / time(num)."""
    return round(
        statistics.median(d / n for n, d in zip(results[num], results[den], strict=True)), 3
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--poll-s", type=float, default=ROLE_POLL_S)
    ap.add_argument("--out", default=None)
    ap.add_argument("--peer", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        return peer_main(*args.peer, args.device)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def pause() -> None:
        if args.poll_s > 0:
            time.sleep(args.poll_s)

    pages = args.tokens // LAYOUT.page_size
    pool_pages = 4 * pages
    nbytes = pages * LAYOUT.page_bytes
    patterns = page_patterns(pages, pool_pages, args.seed)
    g = torch.Generator().manual_seed(args.seed)

    peer = subprocess.Popen(
        [sys.executable, __file__, "--peer", str(pool_pages), str(nbytes), "--device", args.device],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdout is not None and peer.stdin is not None
        stdin, stdout = peer.stdin, peer.stdout

        def peer_line() -> str:
            line = ""
            while not line.startswith("PEER "):
                line = stdout.readline()
                if not line:
                    raise SystemExit("the decode-side peer exited")
            return line[5:]

        info = json.loads(peer_line())
        src = KVPool(LAYOUT, pool_pages, dev)
        src.data.copy_(torch.randint(0, 256, tuple(src.data.shape), dtype=torch.uint8, generator=g))
        agent = NixlAgent(f"bench-p-{os.getpid()}", src)
        nx = agent.agent
        remote = NixlPool(bytes.fromhex(info["md"]), info["base"], 0, info["mem"])
        mem = info["mem"]
        writer = NixlWriter(agent, remote, LAYOUT, pool_pages)

        def run_raw(handle: object) -> None:
            state = nx.transfer(handle)
            while state == "PROC":
                pause()  # polled like pdserve's writes, so only the transfer differs
                state = nx.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL write ended {state}")

        def pdserve_write(src_pages: list[int], dst_pages: list[int]) -> Callable[[], None]:
            def go() -> None:
                x = writer.write(1, 1, src, src_pages, dst_pages, time.monotonic() + 30)
                while not x.poll():
                    pause()

            return go

        handles = []
        methods: list[tuple[str, Callable[[], None]]] = []
        for name, (sp, dp) in patterns.items():
            h = nx.make_prepped_xfer(
                "WRITE", agent.local, run_indices(sp), writer.remote, run_indices(dp),
                notif(1, 1, nbytes),
            )  # fmt: skip
            handles.append(h)
            methods.append((f"pdserve_{name}", pdserve_write(sp, dp)))
            methods.append((f"raw_descs_{name}", lambda h=h: run_raw(h)))

        raw_src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=g).to(dev)
        nx.register_memory(raw_src)
        local = nx.get_xfer_descs([(raw_src.data_ptr(), nbytes, 0)], mem)
        far = nx.get_xfer_descs([(info["raw"], nbytes, 0)], mem)
        raw_handle = nx.initialize_xfer("WRITE", local, far, writer.remote_name, b"raw")
        handles.append(raw_handle)
        methods.append(("raw_nixl_contiguous", lambda: run_raw(raw_handle)))

        # Real bytes: an untouched torch.empty maps the zero page, and copying it is cache-fast.
        a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=g).to(dev)
        b = torch.empty(nbytes, dtype=torch.uint8, device=dev)

        def memcpy() -> None:
            b.copy_(a)
            sync()

        methods.append(("memcpy_contiguous", memcpy))
        if dev.type == "cpu":
            shm_dst = KVPool(LAYOUT, pool_pages, dev, shared=True)
            assert shm_dst.shm is not None
            shm = ShmWriter(shm_dst.shm, LAYOUT, pool_pages)
            shm_src, shm_to = patterns["scattered"]
            methods.append(("shm_scattered", lambda: shm.write(1, 1, src, shm_src, shm_to, 0)))

        for _, fn in methods:
            fn()  # warm-up: connection, registration caches
        results: dict[str, list[float]] = {name: [] for name, _ in methods}
        # Interleave the methods call by call, so that a noisy neighbour or a drifting clock
        # hits all alike; ratios are then taken per pair of neighbouring calls.
        for i in range(args.iters):
            for name, fn in methods if i % 2 == 0 else methods[::-1]:  # no fixed order bias
                results[name].append(timed(fn))
        # The bytes really landed (checked once per pattern, outside the timing).
        for k, (sp, dp) in enumerate(patterns.values()):
            src.page(sp[0]).fill_(k + 1)  # so that a stale copy cannot pass
            pdserve_write(sp, dp)()
            stdin.write(f"check {json.dumps(dp)}\n")
            stdin.flush()
            if int(peer_line()) != checksum(src, sp):
                raise SystemExit("pdserve nixl write: the destination pages differ from the source")
        for h in handles:
            h.release()
        stdin.write("quit\n")
        stdin.flush()
    finally:
        if peer.poll() is None:
            peer.kill()
        peer.wait(10)

    med = {k: statistics.median(v) for k, v in results.items()}
    gbps = {k: nbytes / t / 1e9 for k, t in med.items()}
    by_pattern = {
        name: {
            "descriptors": len(page_spans(*patterns[name])),
            "pdserve_GB_per_s": round(gbps[f"pdserve_{name}"], 3),
            "raw_descs_GB_per_s": round(gbps[f"raw_descs_{name}"], 3),
            "pdserve_vs_raw_contiguous": paired(results, f"pdserve_{name}", "raw_nixl_contiguous"),
            "pdserve_vs_raw_same_descs": paired(results, f"pdserve_{name}", f"raw_descs_{name}"),
            "raw_same_descs_vs_raw_contiguous": paired(
                results, f"raw_descs_{name}", "raw_nixl_contiguous"
            ),
        }
        for name in PATTERNS
    }
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs",
        "command": "python " + " ".join([sys.argv[0], *sys.argv[1:]]),
        "payload": {
            "tokens": args.tokens,
            "bytes": nbytes,
            "pages": pages,
            "page_bytes": LAYOUT.page_bytes,
        },
        "median_s": {k: round(v, 6) for k, v in med.items()},
        "GB_per_s": {k: round(v, 3) for k, v in gbps.items()},
        "patterns": by_pattern,
        "pdserve_scattered_vs_memcpy": round(
            gbps["pdserve_scattered"] / gbps["memcpy_contiguous"], 3
        ),
        "device": args.device,
        "poll_s": args.poll_s,
        "UCX_TLS": os.environ.get("UCX_TLS", "(UCX default)"),
    }
    print(json.dumps(doc, indent=2))
    print(f"\n{'pattern':<15} {'descs':>5} {'pdserve GB/s':>12} {'raw same descs':>14} "
          f"{'pd/raw1':>7} {'pd/rawsame':>10} {'rawsame/raw1':>12}")  # fmt: skip
    for name, r in by_pattern.items():
        print(
            f"{name:<15} {r['descriptors']:>5} {r['pdserve_GB_per_s']:>12.2f} "
            f"{r['raw_descs_GB_per_s']:>14.2f} {r['pdserve_vs_raw_contiguous']:>7.2f} "
            f"{r['pdserve_vs_raw_same_descs']:>10.2f} "
            f"{r['raw_same_descs_vs_raw_contiguous']:>12.2f}"
        )
    print(f"raw NIXL, one contiguous descriptor: {gbps['raw_nixl_contiguous']:.2f} GB/s; "
          f"memcpy {gbps['memcpy_contiguous']:.2f} GB/s")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
