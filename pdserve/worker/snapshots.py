"""What /debug/state shows of a PD role: its peers, its open rooms and its counters.

`pdserve doctor` reads these documents (doctor/diagnosis.py); keep the keys stable.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from pdserve.transfer.receiver import KVReceiver
from pdserve.worker.decode_peers import DecodePeers
from pdserve.worker.decode_rooms import DRoom, PrefillPeer
from pdserve.worker.prefill_rooms import PRoom
from pdserve.worker.roles import RoleStats


def decode_snapshot(
    peers: Iterable[PrefillPeer],
    rooms: Iterable[DRoom],
    admitting: int,
    receiver: KVReceiver,
    stats: RoleStats,
    control: dict[str, object],
) -> dict[str, Any]:
    now = time.monotonic()
    return {
        "peers": [
            {
                "address": p.address,
                "proven": p.proven,
                "registered": p.registered,
                "refused": p.refused,
                "silent_s": round(now - p.last_pong, 3),
                "clock_skew_s": None if p.clock.skew_s is None else round(p.clock.skew_s, 3),
            }
            for p in peers
        ],
        "rooms": [
            {
                "room": r.room,
                "epoch": r.epoch,
                "peer": r.peer,
                "state": r.state.value,
                "request_id": r.request.request_id,
                "pages": len(r.lease),
                "time_in_state_s": round(now - r.since, 3),
                "deadline_in_s": round(r.deadline - now, 3),
                "kv_bytes_received": r.bytes_received,
            }
            for r in rooms
        ],
        "admitting": admitting,
        "backend": receiver.backend,
        "counts_bytes": receiver.counts_bytes,  # KV passes through D: bytes are conserved
        "stats": stats.snapshot(),
        "control": control,
    }


def prefill_snapshot(
    peers: DecodePeers,
    rooms: Iterable[PRoom],
    refusals: Iterable[tuple[float, str, str]],
    stats: RoleStats,
    control: dict[str, object],
) -> dict[str, Any]:
    now = time.monotonic()
    rooms = list(rooms)
    return {
        "peers": [{"identity": p.identity, "silent_s": round(now - p.last_seen, 3)} for p in peers],
        "rooms": [
            {
                "peer": r.peer,
                "room": r.room,
                "epoch": r.epoch,
                "state": r.state.value,
                "time_in_state_s": round(now - r.since, 3),
                "deadline_in_s": round(r.deadline - now, 3),
                "pages": len(r.lease) if r.lease is not None else 0,  # kept for its writes
                "pages_written": r.pages_written,
                "writes_in_flight": len(r.inflight),
            }
            for r in rooms
        ],
        "writes_in_flight": sum(len(r.inflight) for r in rooms),
        "registrations_refused": [
            {"peer": peer, "why": why, "ago_s": round(now - at, 3)} for at, peer, why in refusals
        ],
        "stats": stats.snapshot(),
        "control": control,
    }
