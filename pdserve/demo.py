"""`make run`: start a PD cluster on a real built-in model, talk to it, stop it.

The model is `builtin:smollm2-135m-instruct` (SmolLM2-135M-Instruct, a GGUF file an installed
package ships: model/packaged.py), or PDSERVE_MODEL. By default (PDSERVE_DEMO_MODE=launch) it
starts `pdserve launch --prefill 1 --decode 1` (a router over one prefill and one decode
worker), asks a question through the chat template (greedy), sends streaming and non-streaming
requests, prints the answers, each concurrent request's TTFT, the tokens/s and the KV bytes
moved from prefill to decode. PDSERVE_DEMO_MODE=serve does the same against one co-located
server. Everything started is stopped by its pid (SIGTERM, then SIGKILL after a bound).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pdserve.runtime.cluster_key import ClusterKey, generate

DEFAULT_MODEL = "builtin:smollm2-135m-instruct"
QUESTION = "What is the capital of France?"
READY_TIMEOUT_S = 300.0
STOP_S = {"serve": 20.0, "launch": 75.0}  # a launcher stops a router, then its workers


def post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def stream(url: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    req = urllib.request.Request(
        url, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def start_server(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("READY "):
                found.append(line.split()[1])
                ready.set()
            else:
                sys.stderr.write("  [server] " + line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise SystemExit("the server did not start; see its log above")
    return proc, found[0]


def stop(proc: subprocess.Popen[str], timeout_s: float = STOP_S["serve"]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def timed_completion(url: str, body: dict[str, Any]) -> tuple[float, int]:
    """Stream one completion: (seconds to its first token, completion tokens)."""
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    for chunk in stream(
        url + "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    ):
        if ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
            ttft = time.perf_counter() - t0
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - t0), tokens


def print_transfer(url: str, key: ClusterKey) -> None:
    """KV bytes the prefill workers wrote into decode workers' pages, from /debug/cluster
    (which shows live request ids, so it needs the cluster's key)."""
    req = urllib.request.Request(url + "/debug/cluster", headers=key.http_headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        workers = json.loads(r.read())["workers"]
    for wurl, w in sorted(workers.items()):
        stats = ((w.get("state") or {}).get("engine") or {}).get("role", {}).get("stats")
        if stats is None:
            continue
        if w["role"] == "prefill":
            print(
                f"   prefill {wurl}: {stats['done']} prefills, "
                f"{stats['bytes_written'] / 2**20:.2f} MiB of KV written to decode workers"
            )
        else:
            print(f"   decode  {wurl}: {stats['bytes_acked'] / 2**20:.2f} MiB of KV acknowledged")


def main() -> int:
    model = os.environ.get("PDSERVE_MODEL", DEFAULT_MODEL)
    mode = os.environ.get("PDSERVE_DEMO_MODE", "launch")
    if mode not in STOP_S:
        raise SystemExit(f"PDSERVE_DEMO_MODE must be serve or launch, got {mode!r}")
    key_file = Path(tempfile.mkdtemp(prefix="pdserve-demo-")) / "cluster.key"
    key = generate(key_file)  # the demo reads the cluster's /debug/cluster with it
    cmd = ["serve"] if mode == "serve" else ["launch", "--prefill", "1", "--decode", "1"]
    cmd += ["--cluster-key-file", str(key_file)]
    print(f"== starting pdserve {' '.join(cmd)} --model {model}")
    proc, url = start_server(["--log-level", "WARNING", *cmd, "--model", model, "--port", "0"])
    try:
        print(f"== server ready at {url}\n")
        r = post(
            url + "/v1/chat/completions",
            {
                "model": model,
                "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": 48,
                "temperature": 0,
            },
        )
        print(f"-- chat (greedy)\n{QUESTION}\n{r['choices'][0]['message']['content']}")
        print(f"   finish_reason={r['choices'][0]['finish_reason']} usage={r['usage']}\n")

        prompt = "def fibonacci(n):"
        r = post(
            url + "/v1/completions",
            {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0},
        )
        print(f"-- completion (greedy)\n{prompt}{r['choices'][0]['text']}")
        print(f"   finish_reason={r['choices'][0]['finish_reason']} usage={r['usage']}\n")

        print("-- chat, streamed")
        t0 = time.perf_counter()
        first = None
        n = 0
        body = {
            "model": model,
            "max_tokens": 64,
            "temperature": 0.8,
            "seed": 7,
            "messages": [{"role": "user", "content": "Write a haiku about queues."}],
        }
        for chunk in stream(url + "/v1/chat/completions", body):
            delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if delta:
                first = first or time.perf_counter()
                n += 1
                print(delta, end="", flush=True)
        dt = time.perf_counter() - t0
        print(f"\n   ttft={1000 * ((first or t0) - t0):.1f} ms, {n} chunks in {dt:.2f} s\n")

        print("-- 16 concurrent completions")
        t0 = time.perf_counter()
        results: list[Any] = []
        ttfts: dict[int, tuple[float, int]] = {}

        def one(i: int) -> None:
            body = {"model": model, "prompt": f"item {i}:", "max_tokens": 64, "ignore_eos": True}
            if mode == "launch":
                ttfts[i] = timed_completion(url, body)
            else:
                results.append(post(url + "/v1/completions", body))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        dt = time.perf_counter() - t0
        if mode == "launch":
            for i, (ttft, n) in sorted(ttfts.items()):
                print(f"   request {i:2d}: ttft={1000 * ttft:7.1f} ms, {n} tokens")
            done, toks = len(ttfts), sum(n for _, n in ttfts.values())
        else:
            done, toks = len(results), sum(r["usage"]["completion_tokens"] for r in results)
        print(f"   {done} requests, {toks} tokens in {dt:.2f} s = {toks / dt:.0f} tokens/s")
        if mode == "launch":
            print_transfer(url, key)
        return 0 if done == 16 else 1
    finally:
        stop(proc, STOP_S[mode])
        print(f"== server stopped (exit code {proc.returncode})")


if __name__ == "__main__":
    sys.exit(main())
