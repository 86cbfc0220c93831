"""Control-plane messages between decode (D) and prefill (P) workers, and their one codec.

Every message is a msgspec Struct tagged by its type name and carries the same envelope:
`proto_version, room, epoch, sender`. `decode()` never raises: a frame it cannot read, an
unknown type or another protocol version becomes a `DecodeError` event that the caller
counts and drops (LESSONS #1: no reader thread ever dies on an unexpected frame).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from pdserve.protocol.layout_desc import LayoutDesc
from pdserve.protocol.outputs import TokenLogprob
from pdserve.protocol.sampling import SamplingParams, show

PROTO_VERSION = 1


# The KV data planes between prefill and decode workers, as `Register.backend` names them (the
# one list: transfer/receiver.py and transfer/writers.py open them, config validates against it).
BACKENDS = ("shm", "tcp", "nixl")


class Msg(msgspec.Struct, tag=True, kw_only=True, frozen=True):
    proto_version: int = PROTO_VERSION
    room: int = 0  # 63-bit request id, never reused; 0 for peer-level messages
    epoch: int = 0  # bumps when a room is re-sent, so late events of an old attempt are stale
    sender: str = ""


class NixlPool(msgspec.Struct, frozen=True):
    """D's NIXL agent metadata and where its registered KV pool starts (backend nixl)."""

    agent_md: bytes
    base: int
    device_id: int = 0
    mem: str = "DRAM"  # DRAM | VRAM


class ShmPool(msgspec.Struct, frozen=True):
    """Where D keeps its shared pool open (backend shm, same host): never a path. P opens
    /proc/PID/fd/FD and accepts it only as D's pdserve pool named by `token` (kvcache/pool.py)."""

    pid: int
    fd: int
    token: str


class Hello(Msg, frozen=True):
    """D -> P, before anything else: prove you hold the cluster key. D sends its Register (its
    pool reference, its NIXL metadata) only to a peer whose HelloAck came back signed with the
    key, echoing `nonce` and naming the address D dialled (a relay of another P's answer names
    that P's address instead). Nothing in it is secret."""

    nonce: int


class HelloAck(Msg, frozen=True):
    """P -> D: `nonce` echoed, and `address` the control address P listens on (its /info's)."""

    nonce: int
    address: str


class Register(Msg, frozen=True):
    """D -> P: pair with me. `layout` is D's KV layout, the whole model's (as at TP 1, whatever
    D's `tp`); `shm` its pool (backend shm), rank 0's at TP > 1, `rank_shm` its other ranks'."""

    layout: LayoutDesc
    backend: str
    shm: ShmPool | None = None
    num_pages: int = 0
    nixl: NixlPool | None = None
    # Per-request state slots after the pages (a layout with state: DeepSeek-V4), each of
    # whole pages: P writes a room's state into the slot's pages (PrefillRequest.state_pages).
    state_slots: int = 0
    # D's tensor parallelism: its pages are split over `tp` ranks' pools by KV head
    # (kvcache/rank_pages.py); with shm P writes each rank's heads into that rank's pool.
    tp: int = 1
    rank_shm: list[ShmPool] = msgspec.field(default_factory=list)
    # D runs attention data-parallel (`--dp`): its pages are numbered over its ranks' pools,
    # rank r's `num_pages` following rank r - 1's, each whole in its own rank's pool.
    dp: bool = False
    # D streams a room's FirstToken ahead of its KV: P sends them only to a D that says so (one
    # from before FirstToken leaves it False and would drop them as an unknown type).
    first_tokens: bool = False


class RegisterAck(Msg, frozen=True):
    ok: bool
    error: str | None = None
    layout: LayoutDesc | None = None


class PrefillRequest(Msg, frozen=True):
    prompt_ids: list[int]
    dst_pages: list[int]
    params: SamplingParams  # decoding checks every field (protocol/sampling.py)
    # Wall-clock (unix) time after which P must not write into dst_pages: D fences the pages
    # until then, so a P that was stopped and resumes late cannot write into reused pages.
    write_deadline: float
    # The pages of the room's state slot on D (a layout with per-request state), written once,
    # after the prompt's last chunk; empty otherwise.
    state_pages: list[int] = msgspec.field(default_factory=list)


class PrefillAccept(Msg, frozen=True):
    pass


class PrefillReject(Msg, frozen=True):
    reason: str
    unregistered: bool = False  # P does not know the sender (it restarted): register again


class KVChunk(Msg, frozen=True):
    """P -> D (tcp backend): pages' bytes follow as extra frames, one per page, in order.

    Each page frame is the page's contiguous run: every (layer, buffer) slice, layer-major.
    """

    dst_pages: list[int]


class PrefillDone(Msg, frozen=True):
    """Sent only after every KV write of the room has completed."""

    first_token: int
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs
    kv_bytes: int = 0  # bytes P wrote into the room's pages (D checks conservation)
    state_bytes: int = 0  # of which into its state slot's pages (D checks every one came)
    # The prompt's scores when the request asked (params.prompt_logprobs): one per prompt token
    # after the first (D checks the count).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


class FirstToken(Msg, frozen=True):
    """P -> D, the moment P sampled the room's first token while KV writes of the room are
    still in flight: D may stream it to the client at once, so that the first token does not
    wait for the transfer (worker/decode/role.py). PrefillDone still follows with the same
    token, and decoding still waits for it."""

    token: int
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


class PrefillFailed(Msg, frozen=True):
    reason: str
    # P released writes it could not confirm (deadline, peer error): some bytes may still
    # land, so D must fence the pages rather than free them.
    writes_cancelled: bool = False


class Abort(Msg, frozen=True):
    reason: str = ""


class AbortAck(Msg, frozen=True):
    """P has stopped writing into the room's pages and no write is in flight."""

    known: bool = True
    writes_cancelled: bool = False  # as in PrefillFailed


class Ping(Msg, frozen=True):
    nonce: int = 0
    sent_at: float = 0.0  # the sender's unix time (0: not given)


class Pong(Msg, frozen=True):
    """P's control thread answers at once, so a long compute step does not look like death;
    `engine_busy_s` says how long P's engine has been inside its current tick, so that a D
    can still tell a stalled engine from a slow step. `ping_sent_at` echoes the Ping's
    `sent_at` and `sent_at` is P's unix time: D estimates the clocks' skew from the two."""

    nonce: int = 0
    engine_busy_s: float = 0.0
    ping_sent_at: float = 0.0
    sent_at: float = 0.0


Message = (
    Hello
    | HelloAck
    | Register
    | RegisterAck
    | PrefillRequest
    | PrefillAccept
    | PrefillReject
    | KVChunk
    | FirstToken
    | PrefillDone
    | PrefillFailed
    | Abort
    | AbortAck
    | Ping
    | Pong
)
MESSAGE_TYPES: tuple[type[Msg], ...] = (
    Hello,
    HelloAck,
    Register,
    RegisterAck,
    PrefillRequest,
    PrefillAccept,
    PrefillReject,
    KVChunk,
    FirstToken,
    PrefillDone,
    PrefillFailed,
    Abort,
    AbortAck,
    Ping,
    Pong,
)


class Send(NamedTuple):
    """A message a role wants sent: the roles return these instead of calling the control plane
    (the engine hands them to its transport; a test hands them to the other role)."""

    peer: str  # P: the D's identity; D: the P's control address
    msg: Msg  # `sender` already set to the role's identity


@dataclass(frozen=True)
class DecodeError:
    """A frame that could not be read; `kind` is one of malformed | unknown_type | version.
    A malformed frame of a known type whose envelope reads says which (`of`, `room`, `epoch`):
    the receiver can then answer it (a PrefillRequest with bad params gets its PrefillReject)."""

    kind: str
    detail: str
    of: str = ""  # the message type it claims, when known and its envelope reads
    room: int = 0
    epoch: int = 0


class Unreadable(Msg, frozen=True):
    """Not a wire message (the decoder never yields it): a DecodeError that names its type,
    handed to the role as a message so that it can answer the sender (transfer/control.py)."""

    of: str
    detail: str


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_probe = msgspec.msgpack.Decoder(dict)


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes) -> Message | DecodeError:
    try:
        msg = _decoder.decode(frame)
    except msgspec.DecodeError as e:
        return _classify(frame, str(e))
    if msg.proto_version != PROTO_VERSION:
        return DecodeError("version", f"proto_version {msg.proto_version} != {PROTO_VERSION}")
    return msg


def _classify(frame: bytes, detail: str) -> DecodeError:
    try:
        obj = _probe.decode(frame)
    except msgspec.DecodeError:
        return DecodeError("malformed", detail)
    tag = obj.get("type")
    known = {t.__name__ for t in MESSAGE_TYPES}
    if not isinstance(tag, str) or tag not in known:  # a list is unhashable: never `in` a set
        return DecodeError("unknown_type", f"type {show(tag)}")
    room, epoch = obj.get("room", 0), obj.get("epoch", 0)
    if not (_envelope_int(room) and _envelope_int(epoch)):
        return DecodeError("malformed", detail)
    assert isinstance(room, int) and isinstance(epoch, int)
    return DecodeError("malformed", detail, of=tag, room=room, epoch=epoch)


def _envelope_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63
