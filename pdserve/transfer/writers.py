"""The prefill side's writer for one decode worker, opened from that worker's Register.

The one place a backend's name picks a writer (the decode side's counterpart is
transfer/receiver.py). Each check raises ValueError (or the backend's own error) saying what
is wrong with the registration; the caller refuses it with that text.
"""

from __future__ import annotations

from collections.abc import Callable

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
) -> PeerWriter:
    """A writer into the pool `msg` describes (`layout`, already compared with ours).
    `peer`: the decode worker's identity; `identity`: ours; `control`: tcp sends page frames
    on it; `nixl_agent`: our NIXL agent, created on first use."""
    rows = pool_rows(layout, msg.num_pages, msg.state_slots)  # its pages, then its slots'
    if msg.backend == "shm":
        if msg.shm is None:
            raise ValueError("backend shm needs the decode pool's shm reference")
        ref = ShmRef(msg.shm.pid, msg.shm.fd, msg.shm.token)
        return ShmWriter(ref, layout, rows, copier)
    if msg.backend == "tcp":
        if control is None:
            raise ValueError("backend tcp is not available on this prefill worker")
        return TcpWriter(control, peer, identity, copier)
    if msg.backend == "nixl":
        if msg.nixl is None:
            raise ValueError("backend nixl needs the decode pool's NIXL descriptor")
        return NixlWriter(nixl_agent(), msg.nixl, layout, rows)
    raise ValueError(f"unknown backend {msg.backend!r}; known: {', '.join(m.BACKENDS)}")
