"""The prefill side's writer for one decode worker, opened from that worker's Register.

The one place a backend's name picks a writer (the decode side's counterpart is
transfer/receiver.py). Each check raises ValueError (or the backend's own error) saying what
is wrong with the registration; the caller refuses it with that text.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.config import MAX_TP
from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import ShmRef, pool_rows
from pdserve.protocol import messages as m
from pdserve.transfer.control import Control
from pdserve.transfer.copier import Copier
from pdserve.transfer.dataplane import PeerWriter, ShmWriter, TcpWriter
from pdserve.transfer.nixl import NixlAgent, NixlWriter


def open_writer(
    msg: m.Register,
    peer: str,
    layout: KVLayout,
    *,
    identity: str,
    control: Control | None,
    copier: Copier | None,
    nixl_agent: Callable[[], NixlAgent],
    tp: int = 1,
    own_pids: frozenset[int] = frozenset(),
) -> PeerWriter:
    """A writer into the pool `msg` describes (`layout`, the whole model's, already compared
    with ours). `peer`: the decode worker's identity; `identity`: ours; `control`: tcp sends
    page frames on it; `nixl_agent`: our NIXL agent, created on first use; `tp`: our
    tensor parallelism (our pages read whole from our ranks' pools); `own_pids`: our follower
    ranks' processes, whose (shared) pools a peer may never name."""
    rows = pool_rows(layout, msg.num_pages, msg.state_slots)  # its pages, then its slots'
    if not 1 <= msg.tp <= MAX_TP:
        raise ValueError(f"a decode worker of tensor parallelism {msg.tp} (1 to {MAX_TP})")
    if msg.dp and (msg.tp == 1 or msg.state_slots):
        raise ValueError(
            f"a decode worker with data-parallel attention over {msg.tp} rank(s) and "
            f"{msg.state_slots} state slots: it needs 2 or more ranks and no per-request state"
        )
    if msg.backend == "shm":
        shms = [msg.shm, *msg.rank_shm] if msg.shm is not None else []
        if len(shms) != msg.tp:
            raise ValueError(
                f"backend shm needs each of the decode worker's {msg.tp} ranks' pool "
                f"references, got {len(shms)}"
            )
        refs = [ShmRef(s.pid, s.fd, s.token) for s in shms if s is not None]
        if len({(r.pid, r.fd) for r in refs}) != len(refs):
            raise ValueError("backend shm: the decode worker's ranks name one pool twice")
        if any(r.pid in own_pids for r in refs):
            raise ValueError("backend shm: the shm pool reference does not name a pdserve KV pool")
        return ShmWriter(refs, layout, rows, copier, dp=msg.dp)
    if msg.backend == "tcp":
        if control is None:
            raise ValueError("backend tcp is not available on this prefill worker")
        return TcpWriter(control, peer, identity, copier)
    if msg.backend == "nixl":
        if msg.nixl is None:
            raise ValueError("backend nixl needs the decode pool's NIXL descriptor")
        if msg.tp != 1 or tp != 1:
            raise ValueError(
                f"backend nixl writes one pool into one pool; tp: {tp} (prefill) vs "
                f"{msg.tp} (decode): use shm or tcp between tensor-parallel workers"
            )
        return NixlWriter(nixl_agent(), msg.nixl, layout, rows)
    raise ValueError(f"unknown backend {msg.backend!r}; known: {', '.join(m.BACKENDS)}")
