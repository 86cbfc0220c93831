"""A prefill worker and a decode worker as real processes, per data-plane backend."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import zmq

from pdserve.runtime.cluster_key import ClusterKey
from pdserve.transfer.frame_auth import FrameAuth
from tests.helpers import OpenZap, join_as_member
from tests.procs import ServerProcess, auth_headers, http, worker_args

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
            auth_headers(),
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


class KeyedSocket:
    """A raw ZMQ socket of a cluster member: what it sends is signed with the run's cluster key
    (tests/conftest.py), what it receives is checked and unwrapped. A test plays a peer that
    holds the key but sends what it likes."""

    def __init__(self, kind: int, identity: str) -> None:
        key = ClusterKey.from_env(None)
        assert key is not None
        self.auth = FrameAuth(key, identity)
        # A prefill worker's ROUTER takes D's PLAIN handshake (any password: the test's fake).
        self.zap = OpenZap() if kind == zmq.ROUTER else None
        ctx_socket = zmq.Context.instance().socket if self.zap is None else self.zap.socket
        self.sock = ctx_socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.DEALER:
            self.sock.setsockopt(zmq.IDENTITY, identity.encode())
            join_as_member(self.sock, key)

    def send(self, *frames: bytes, to: bytes | None = None) -> None:
        """Signed frames; `to`: the routing identity, on a ROUTER socket."""
        self.sock.send_multipart(([to] if to is not None else []) + self.auth.sign(list(frames)))

    def recv(self, timeout_ms: int = 10_000) -> tuple[bytes | None, list[bytes]]:
        """(the sender's routing identity on a ROUTER, else None; the frames after auth)."""
        assert self.sock.poll(timeout_ms), "nothing arrived in time"
        parts = self.sock.recv_multipart()
        ident = parts.pop(0) if self.sock.type == zmq.ROUTER else None
        assert self.auth.check(ident.decode() if ident else None, parts) is None, parts[:1]
        return ident, parts[1:]

    def close(self) -> None:
        self.sock.close(0)
        if self.zap is not None:
            self.zap.close()


def tokens(lines: list[dict]) -> list[int]:
    assert lines[-1]["finish_reason"] in ("length", "stop"), str(lines[-1])
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
