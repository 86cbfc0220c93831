"""Test shorthands: the offline engine API, a raw socket with a member's handshake."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import zmq

from pdserve.engine.engine import Engine
from pdserve.engine.offline import build_engine, generate
from pdserve.runtime.cluster_key import ClusterKey
from pdserve.transfer.control_handshake import ZAP_ENDPOINT, HandshakeKeys, configured_handshake

run = generate


def make_engine(
    path: Path,
    page_size: int = 16,
    chunk: int = 32,
    max_running: int = 32,
    kv_mb: float = 16.0,
    max_model_len: int = 1024,
    overlap: bool | None = None,
    kv_dtype: str = "auto",
) -> Engine:
    return build_engine(
        path,
        page_size=page_size,
        max_batched_tokens=chunk,
        max_running=max_running,
        kv_budget_mb=kv_mb,
        max_model_len=max_model_len,
        overlap_schedule=overlap,
        kv_dtype=kv_dtype,
    )


def hf_greedy(path: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF transformers' float32 greedy `generate` of each prompt alone, EOS off: the oracle."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])  # the mask: a prompt token of id 0 is not padding
            ids = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(ids[0, len(p) :].tolist())
    return out


def split_counter(backend: Any) -> list[int]:
    """Each split step's decode count, per layer (attention/mla_backend.py `split`)."""
    split, decodes = backend.split, []

    def counted(metadata: Any) -> Any:
        parts = split(metadata)
        if parts is not None:
            decodes.append(parts.decodes)
        return parts

    backend.split = counted
    return decodes


def join_as_member(sock: zmq.Socket[bytes], key: ClusterKey) -> zmq.Socket[bytes]:
    """Give a raw ZMQ DEALER a member's handshake (transfer/control_handshake.py, as this
    process's environment configures it), before it connects to a prefill worker. A test's
    socket without it is a stranger, refused at the handshake; with it and no frame MAC it
    plays one who learned the handshake (PLAIN's password crosses the wire) but not the key."""
    HandshakeKeys.derive(key, configured_handshake()).connect_as_client(sock)
    return sock


class OpenZap:
    """A ZMQ context whose ZAP handler lets every PLAIN client in: for a test's fake prefill
    worker (PLAIN needs a handler to accept anyone; what the fake does with the connection is
    the test). `socket(kind)` makes a PLAIN server socket in it; `close()` ends all of it."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._rep = self.ctx.socket(zmq.REP)
        self._rep.setsockopt(zmq.LINGER, 0)
        self._rep.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._answer, daemon=True, name="open-zap")
        self._thread.start()

    def socket(self, kind: int) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.PLAIN_SERVER, 1)
        return sock

    def _answer(self) -> None:
        while not self._stop.is_set():
            if self._rep.poll(50):
                request = self._rep.recv_multipart()
                self._rep.send_multipart([b"1.0", request[1], b"200", b"OK", b"", b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._rep.close(0)
        self.ctx.destroy(linger=0)
