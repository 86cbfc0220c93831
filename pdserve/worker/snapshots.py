"""What /debug/state shows of a PD role: its peers, its open rooms and its counters.

`pdserve doctor` reads these documents (doctor/diagnosis.py); keep the keys stable.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.worker.decode import DecodeEngine
    from pdserve.worker.prefill import PrefillEngine


def decode_snapshot(e: DecodeEngine) -> dict[str, Any]:
    now = time.monotonic()
    return {
        "peers": [
            {
                "address": p.address,
                "registered": p.registered,
                "refused": p.refused,
                "silent_s": round(now - p.last_pong, 3),
            }
            for p in e.peers.values()
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
            for r in e.rooms.values()
        ],
        "admitting": len(e.admitting),
        "backend": e.backend,
        "stats": e.stats.snapshot(),
        "control": e.control.stats.snapshot(),
    }


def prefill_snapshot(e: PrefillEngine) -> dict[str, Any]:
    now = time.monotonic()
    return {
        "peers": [
            {"identity": p.identity, "silent_s": round(now - p.last_seen, 3)} for p in e.peers
        ],
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
            for r in e.rooms.values()
        ],
        "writes_in_flight": sum(len(r.inflight) for r in e.rooms.values()),
        "registrations_refused": [
            {"peer": peer, "why": why, "ago_s": round(now - at, 3)} for at, peer, why in e.refusals
        ],
        "stats": e.stats.snapshot(),
        "control": e.control.stats.snapshot(),
    }
