"""The decode side of the data plane: how a decode worker learns that a room's KV landed.

Beside the prefill side's writers (transfer/dataplane.py, transfer/nixl.py) each backend has a
receiver on D, and the decode role talks only to this interface, never to a backend by name:

* `registration()`: what D's `Register` carries so P can open a writer (the shm pools'
  references, one per rank, the NIXL agent's descriptor, or nothing for tcp);
* `landed()`: every `Landed(room, epoch, nbytes)` since the last call. tcp reports the pages
  of a `KVChunk` (staged by transfer/stager.py, handed in by `accept_rows`), nixl its WRITE
  notifications;
* `counts_bytes`: whether D must see PrefillDone's `kv_bytes` land before decoding (tcp, nixl:
  the bytes pass through something D can observe); with shm, P wrote straight into D's pool and
  PrefillDone follows its last copy, so there is nothing to count;
* `bytes_may_trail`: whether bytes may land after PrefillDone arrives (nixl's notifications
  travel apart from the control socket; tcp frames precede PrefillDone on the same socket).

`open_receiver` is the one place a backend's name picks the receiver; `BACKENDS`
(protocol/messages.py) is the one list of names. D's pool must be created in shared memory for
shm (`needs_shared_pool`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from pdserve.kvcache.pool import KVPool
from pdserve.kvcache.rank_pages import RankPages
from pdserve.protocol.messages import BACKENDS, NixlPool, Register, ShmPool
from pdserve.transfer.nixl import INSTALL_HINT, NixlAgent, nixl_available


class Landed(NamedTuple):
    room: int
    epoch: int
    nbytes: int


class KVReceiver(Protocol):
    backend: str
    counts_bytes: bool
    bytes_may_trail: bool
    stages_frames: bool  # KV pages come as bulk frames that D's stager checks and stages

    def registration(self) -> tuple[list[ShmPool], NixlPool | None]: ...

    def accept_rows(
        self, room: int, epoch: int, dst_pages: Sequence[int], rows: torch.Tensor | None
    ) -> int:
        """tcp: write a KVChunk's staged pages (`StagedChunk.rows`, None for a chunk that was
        not staged) into the pool (the caller checked that the room holds `dst_pages`);
        raises ValueError on a malformed chunk or another backend."""
        ...

    def landed(self) -> list[Landed]: ...

    def settle(self) -> None:
        """At shutdown: let what is still queued fail (nixl drives UCX for a bounded time)."""
        ...

    hard_exit: bool  # the process must leave without interpreter teardown (nixl: UCX)


class ShmReceiver:
    hard_exit = False
    backend = "shm"
    counts_bytes = False
    bytes_may_trail = False
    stages_frames = False

    def __init__(self, pages: RankPages) -> None:
        if any(ref is None for ref in pages.refs):
            raise ValueError("backend shm needs every rank's KV pool in shared memory")
        self.refs = [ref for ref in pages.refs if ref is not None]

    def registration(self) -> tuple[list[ShmPool], NixlPool | None]:
        return [ShmPool(pid=r.pid, fd=r.fd, token=r.token) for r in self.refs], None

    def accept_rows(
        self, room: int, epoch: int, dst_pages: Sequence[int], rows: torch.Tensor | None
    ) -> int:
        raise ValueError("a KVChunk on the shm backend (pages arrive through shared memory)")

    def landed(self) -> list[Landed]:
        return []

    def settle(self) -> None:
        pass


class TcpReceiver:
    hard_exit = False
    backend = "tcp"
    counts_bytes = True
    bytes_may_trail = False
    stages_frames = True

    def __init__(self, pages: RankPages) -> None:
        self.pages = pages
        self._landed: list[Landed] = []

    def registration(self) -> tuple[list[ShmPool], NixlPool | None]:
        return [], None

    def accept_rows(
        self, room: int, epoch: int, dst_pages: Sequence[int], rows: torch.Tensor | None
    ) -> int:
        per_page = self.pages.page_bytes
        if rows is None or rows.shape != (len(dst_pages), per_page):
            got = "no staged pages" if rows is None else f"rows of shape {tuple(rows.shape)}"
            raise ValueError(f"KVChunk: {got} for {len(dst_pages)} pages of {per_page} bytes")
        if len(dst_pages):
            # From pinned memory to a GPU pool the copy is queued on the engine's stream, ahead
            # of any step that reads the pages; the host allocator keeps `rows` until it ran.
            on_device = rows.to(self.pages.pools[0].device, non_blocking=True)
            self.pages.write(dst_pages, list(on_device))
        moved = per_page * len(dst_pages)
        self._landed.append(Landed(room, epoch, moved))
        return moved

    def landed(self) -> list[Landed]:
        out, self._landed = self._landed, []
        return out

    def settle(self) -> None:
        pass


class NixlReceiver:
    hard_exit = True
    backend = "nixl"
    counts_bytes = True
    bytes_may_trail = True
    stages_frames = False

    def __init__(self, identity: str, pool: KVPool) -> None:
        self.agent = NixlAgent(identity, pool)

    def registration(self) -> tuple[list[ShmPool], NixlPool | None]:
        return [], self.agent.descriptor()

    def accept_rows(
        self, room: int, epoch: int, dst_pages: Sequence[int], rows: torch.Tensor | None
    ) -> int:
        raise ValueError("a KVChunk on the nixl backend (pages arrive by NIXL WRITE)")

    def landed(self) -> list[Landed]:
        return [Landed(*n) for n in self.agent.landed()]

    def settle(self) -> None:
        self.agent.settle()


def choose_backend(requested: str, device: str) -> str:
    """`--backend auto`: shm where the KV pool is host memory (P writes straight into D's
    pool), NIXL where it is on a GPU (VRAM to VRAM), tcp on a GPU host without NIXL. Any
    other name is the user's choice, checked by `unavailable`."""
    if requested != "auto":
        return requested
    if device == "cpu":
        return "shm"
    return "nixl" if nixl_available() else "tcp"


def resolve_backend(requested: str, device: str, moves_kv: bool) -> tuple[str, str | None]:
    """(the data plane, why it cannot work here or None) for `serve` and `launch`. A worker
    that moves no KV (co-located) keeps the default and loads nothing: resolving `auto` may
    import NIXL."""
    if not moves_kv:
        return ("shm" if requested == "auto" else requested), None
    backend = choose_backend(requested, device)
    return backend, unavailable(backend, device)


def unavailable(backend: str, device: str = "cpu") -> str | None:
    """Why a decode worker on `device` cannot receive KV over `backend` on this host; None if
    it can. (A prefill worker writes over whatever its decode peer registered.)"""
    if backend == "nixl" and not nixl_available():
        return f"--backend nixl needs NIXL: {INSTALL_HINT}"
    if backend == "shm" and device != "cpu":
        return (
            "--backend shm places the decode pool in shared host memory, and a pool on "
            f"{device} is not: use --backend nixl (VRAM to VRAM) or tcp, or leave --backend auto"
        )
    return None


def needs_shared_pool(backend: str) -> bool:
    """Whether D's KV pool must live in shared memory for `backend`."""
    return backend == "shm"


def register_message(receiver: KVReceiver, pool: KVPool, pages: RankPages) -> Register:
    """What pairs a decode worker with a prefill worker: its pages by the whole model's typed
    layout, its tensor parallelism, the backend, and where P writes (the shm segments, one per
    rank, or the NIXL agent and descriptors)."""
    shms, nixl = receiver.registration()
    return Register(
        layout=pages.layout.to_desc(),
        backend=receiver.backend,
        shm=shms[0] if shms else None,
        nixl=nixl,
        num_pages=pool.num_pages,
        state_slots=pool.state_slots,
        tp=pages.tp,
        rank_shm=shms[1:],
        dp=pages.dp,
        first_tokens=True,  # worker/decode/role.py streams them (engine/role.py StreamFirst)
    )


def open_receiver(backend: str, identity: str, pool: KVPool, pages: RankPages) -> KVReceiver:
    """D's receiver for `backend` (`pool`: rank 0's, `pages`: every rank's as the whole
    model's); raises ValueError for a name not in BACKENDS, or nixl at TP > 1."""
    if backend == "shm":
        return ShmReceiver(pages)
    if backend == "tcp":
        return TcpReceiver(pages)
    if backend == "nixl":
        if pages.tp != 1:
            raise ValueError("backend nixl receives into one pool: at --tp > 1 use shm or tcp")
        return NixlReceiver(identity, pool)
    raise ValueError(f"unknown KV backend {backend!r}; known: {', '.join(BACKENDS)}")
