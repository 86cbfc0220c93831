"""What /debug/state shows of the prefill role: its peers, its open rooms and its counters.

`pdserve doctor` reads this document (doctor/diagnosis.py); keep the keys stable. Times are
relative to `now` (monotonic), the caller's clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pdserve.worker.pd_role import RoleStats
from pdserve.worker.prefill.peers import DecodePeers
from pdserve.worker.prefill.rooms import PRoom


def prefill_snapshot(
    peers: DecodePeers,
    rooms: Iterable[PRoom],
    refusals: Iterable[tuple[float, str, str]],
    stats: RoleStats,
    control: dict[str, object],
    now: float,
) -> dict[str, Any]:
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
