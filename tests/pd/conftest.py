"""A prefill worker and a decode worker as real processes, per data-plane backend."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.procs import ServerProcess, http, worker_args

CHUNK = 48  # P's prefill chunk: prompts longer than this are prefilled in several steps


@dataclass
class PD:
    p: ServerProcess
    d: ServerProcess
    control: str  # P's control address, what D is told to use
    backend: str

    def generate(
        self,
        rid: str,
        prompt: list[int],
        max_tokens: int = 12,
        prefill: bool = True,
        timeout: float = 60.0,
        **params: object,
    ) -> list[dict]:
        body: dict[str, object] = {
            "request_id": rid,
            "prompt_ids": prompt,
            "params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **params},
        }
        if prefill:
            body["prefill"] = self.control
        req = urllib.request.Request(
            self.d.url + "/generate",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return [json.loads(line) for line in r if line.strip()]

    def wait_quiet(self, timeout_s: float = 30.0) -> None:
        """Both workers' invariants hold (no live request, no room, every page free)."""
        deadline = time.monotonic() + timeout_s
        while True:
            d = http("GET", self.d.url + "/debug/invariants")[1]
            p = http("GET", self.p.url + "/debug/invariants")[1]
            if d["ok"] and p["ok"]:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not quiet after {timeout_s}s: D {d} P {p}")
            time.sleep(0.1)


def tokens(lines: list[dict]) -> list[int]:
    assert lines[-1]["finish_reason"] in ("length", "stop"), lines[-1]
    return [t for ln in lines for t in ln["token_ids"]]


@pytest.fixture(scope="module", params=["shm", "tcp", "nixl"])
def pd(request, tiny_dir, tmp_path_factory) -> Iterator[PD]:
    backend = request.param
    logs = tmp_path_factory.mktemp(f"pd-{backend}")
    common = worker_args(tiny_dir, backend, CHUNK)
    with (
        ServerProcess(["serve", "--role", "prefill", *common], logs / "p.log") as p,
        ServerProcess(["serve", "--role", "decode", *common], logs / "d.log") as d,
    ):
        control = http("GET", p.url + "/info")[1]["control"]
        yield PD(p, d, control, backend)
