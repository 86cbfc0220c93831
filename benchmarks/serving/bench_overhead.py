"""How many requests/s `pdserve bench` itself can drive: against a stub that answers at once.

    python benchmarks/serving/bench_overhead.py [--num-prompts 2000] [--repeats 3]

The stub (pdserve/bench/stub.py) runs in its own process and answers every streamed
completion with a fixed, prebuilt SSE stream (--tokens one-token chunks, finish, usage,
[DONE]), so the figure is the client's ceiling: parsing, timing and bookkeeping per request.
Each repeat is a fresh `pdserve bench --request-rate inf` process; prints every repeat's
requests/s and the median.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

READY_TIMEOUT_S = 30.0
BENCH_TIMEOUT_S = 300.0


def start_stub(tokens: int) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.bench.stub", "--tokens", str(tokens)],
        stdout=subprocess.PIPE,
        text=True,
    )
    url: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("READY "):
                url.append(line.split()[1])
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(READY_TIMEOUT_S):
        proc.kill()
        proc.wait(10)
        raise RuntimeError("the stub server printed no READY line")
    return proc, url[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=8, help="chunks per streamed answer")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-concurrency", type=int, default=None)
    args = p.parse_args()
    stub, url = start_stub(args.tokens)
    rates: list[float] = []
    try:
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "run.json"
                argv = [sys.executable, "-m", "pdserve", "bench", "--url", url, "--no-progress"]
                argv += ["--request-rate", "inf", "--num-prompts", str(args.num_prompts)]
                argv += ["--output-len", str(args.tokens), "--input-len", "16"]
                argv += ["--out", str(out)]
                if args.max_concurrency:
                    argv += ["--max-concurrency", str(args.max_concurrency)]
                subprocess.run(argv, check=True, capture_output=True, timeout=BENCH_TIMEOUT_S)
                s = json.loads(out.read_text())["summary"]
            if s["failed"]:
                raise RuntimeError(f"requests failed against the stub: {s['errors']}")
            rates.append(s["request_throughput"])
            print(f"{s['completed']} requests in {s['duration_s']:.2f}s: {rates[-1]:.0f} req/s")
    finally:
        stub.send_signal(signal.SIGTERM)
        try:
            stub.wait(10)
        except subprocess.TimeoutExpired:
            stub.kill()
            stub.wait(10)
    cap = args.max_concurrency or "none"
    print(
        f"median {statistics.median(rates):.0f} req/s over {args.repeats} runs "
        f"({args.num_prompts} requests, {args.tokens} chunks each, concurrency cap {cap})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
