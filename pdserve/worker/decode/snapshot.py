"""What /debug/state shows of the decode role: its peers, its open rooms and its counters.

`pdserve doctor` reads this document (doctor/diagnosis.py); keep the keys stable. Times are
relative to `now` (monotonic), the caller's clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pdserve.transfer.receiver import KVReceiver
from pdserve.worker.decode.rooms import DRoom, PrefillPeer
from pdserve.worker.pd_role import RoleStats


def decode_snapshot(
    peers: Iterable[PrefillPeer],
    rooms: Iterable[DRoom],
    admitting: int,
    receiver: KVReceiver,
    stats: RoleStats,
    control: dict[str, object],
    prefill: dict[str, Any],
    now: float,
    stager: dict[str, int] | None = None,
) -> dict[str, Any]:
    """`prefill`: DecodeMetrics.snapshot, where this worker's requests were prefilled;
    `stager`: Stager.snapshot (tcp), None without one."""
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
        "prefill": prefill,  # {remote, local, last_local_age_s, first_tokens_ahead}: doctor reads
        "control": control,
        "stager": stager,  # tcp: KV chunks staged and refused, bytes in transit
    }
