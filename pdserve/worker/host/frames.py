"""The frames between a worker and its engine process (`serve --engine-process`), and their codec.

The worker (the parent: aiohttp, the APIs, health) and the engine process (the child: the
engine thread, the role, the control and data-plane threads) share one AF_UNIX stream socket,
made by the parent with `socketpair` and inherited by the child: nothing on it comes from
outside the process pair. docs/architecture.md §Engine process.

    down (worker -> engine)   Setup (first, once), Submit, AbortRequest, Query, SetFaults, Stop
    up   (engine -> worker)   Ready (first, once), Outputs, Status, Reply, Fatal, Stopped

A frame is a 4-byte big-endian length and one msgpack value, a msgspec Struct tagged by its
type name. `Frames.feed` splits a byte stream into frames and `decode` never raises: bytes
that are not a frame become a `Garbled` value, which the reader treats as its peer's failure
(the two processes run the same code; a garbled frame is a bug, not an input to survive).
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from pdserve.config import ServerConfig
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams

HEADER = struct.Struct(">I")
MAX_FRAME = 256 * 2**20  # a Submit is bounded by the HTTP body limit (64 MiB); a snapshot far less


class Frame(msgspec.Struct, tag=True, frozen=True, array_like=True):
    pass


# -- down: worker -> engine process ---------------------------------------------------------
class Setup(Frame, frozen=True):
    """What the engine process builds: the server's config (without the API key), the
    tokenizer's end-of-sequence ids, torch's CPU threads (0: its default), the log level."""

    server: ServerConfig
    eos_token_ids: list[int]
    threads: int
    log_level: str


class Submit(Frame, frozen=True):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    timeout_s: float | None
    prefill: str | None  # decode role: the prefill worker's control address


class AbortRequest(Frame, frozen=True):
    request_id: str


class Query(Frame, frozen=True):
    """Answered by a Reply with the same `qid`: "state" (the engine's snapshot and the engine
    process's threads), "metrics" (Prometheus text) or "faults" (the fault points)."""

    qid: int
    what: str
    timeout_s: float


class SetFaults(Frame, frozen=True):
    qid: int
    spec: str
    seed: int


class Stop(Frame, frozen=True):
    """Stop the threads, close the pool and exit; answered by Stopped."""


# -- up: engine process -> worker -----------------------------------------------------------
class Ready(Frame, frozen=True):
    """The engine is built and its threads run. `info`: what the worker's /info adds (the
    layout, the role's identity and control address)."""

    info: dict[str, Any]
    max_model_len: int
    vocab_size: int
    pid: int


class Outputs(Frame, frozen=True):
    """Every output the engine emitted in one tick, in order."""

    outputs: list[RequestOutput]


class Status(Frame, frozen=True):
    """Sent every ENGINE_STATUS_EVERY_S: what the worker's /health and its drain read."""

    problems: list[str]  # the engine process's: its threads, the engine's tick, overdue requests
    has_work: bool


class Reply(Frame, frozen=True):
    qid: int
    value: Any
    error: str | None = None


class Fatal(Frame, frozen=True):
    """A supervised thread of the engine process died for good: the worker stops (exit 1)."""

    why: str


class Stopped(Frame, frozen=True):
    """The answer to Stop: the threads that did not stop in time (None: the supervisor did
    not answer)."""

    stuck: list[str] | None


Down = Setup | Submit | AbortRequest | Query | SetFaults | Stop
Up = Ready | Outputs | Status | Reply | Fatal | Stopped


class Garbled(msgspec.Struct, frozen=True):
    """Bytes that were not a frame; `why` says how."""

    why: str


_encoder = msgspec.msgpack.Encoder()
_down = msgspec.msgpack.Decoder(Down)  # type: ignore[arg-type]  # a union of Structs
_up = msgspec.msgpack.Decoder(Up)  # type: ignore[arg-type]


def encode(frame: Frame) -> bytes:
    """The frame with its length header."""
    body = _encoder.encode(frame)
    return HEADER.pack(len(body)) + body


class Frames:
    """Splits one direction's byte stream into decoded frames; `up` picks the direction."""

    def __init__(self, up: bool) -> None:
        self._decoder = _up if up else _down
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        """The frames `data` completes (Up or Down values, or Garbled); never raises."""
        self._buf += data
        out: list[Any] = []
        buf = self._buf
        at = 0
        while len(buf) - at >= HEADER.size:
            (n,) = HEADER.unpack_from(buf, at)
            if n > MAX_FRAME:
                out.append(Garbled(f"a frame of {n} bytes (at most {MAX_FRAME})"))
                buf.clear()  # nothing after it can be found again
                return out
            if len(buf) - at - HEADER.size < n:
                break
            body = bytes(buf[at + HEADER.size : at + HEADER.size + n])
            at += HEADER.size + n
            try:
                out.append(self._decoder.decode(body))
            except (msgspec.DecodeError, ValueError, TypeError) as e:
                out.append(Garbled(f"{type(e).__name__}: {e}"))
        del buf[:at]
        return out
