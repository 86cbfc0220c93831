"""What /debug/state shows of an engine: every live request with its state and age, the pool.

Built on the engine thread (the SnapshotQuery command), from plain values, so that it reads
one consistent moment. `pdserve doctor` reads these keys (doctor/diagnosis.py): keep them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pdserve.engine.request import Request
from pdserve.engine.role import Room
from pdserve.kvcache.lease import Leases
from pdserve.kvcache.pool import KVPool
from pdserve.kvcache.prefix_cache import PrefixCache


def request_row(r: Request, now: float) -> dict[str, Any]:
    return {
        "request_id": r.request_id,
        "state": r.status.value,
        "time_in_state_s": round(now - r.state_since, 3),
        "deadline_in_s": None if r.deadline is None else round(r.deadline - now, 3),
        "age_s": round(now - r.arrival, 3),
        "prompt_tokens": len(r.prompt_ids),
        "output_tokens": len(r.output_ids),
        "computed_tokens": r.num_computed,
        "pages": len(r.pages),
        "preemptions": r.num_preemptions,
    }


def engine_snapshot(
    role: dict[str, Any],
    steps: int,
    max_model_len: int,
    pool: KVPool,
    leases: Leases,
    requests: Sequence[Request],
    cache: PrefixCache | None = None,
) -> dict[str, Any]:
    """`pool.leases` counts the leases of requests, rooms and host loads in flight (the prefix
    cache's is its own); `pool.pages_cached` the pages only the prefix cache holds (in use, but
    evictable). `pool.lease_violations` covers the cache and its host tier too: the host
    pool's accounting (free + used = total, every indexed page in use once, pins = loads)."""
    now = time.monotonic()
    violations = leases.violations() + (cache.violations() if cache is not None else [])
    return {
        "role": role,
        "steps": steps,
        "max_model_len": max_model_len,
        "pool": {
            "pages_total": pool.allocator.num_pages,  # every data-parallel rank's
            "page_size": pool.page_size,
            "pages_free": pool.allocator.num_free,
            "pages_used": pool.allocator.num_used,
            "pages_cached": pool.allocator.num_evictable,
            # Pages in use (cached ones included) per pool part: each data-parallel rank's
            # with --dp, else one entry.
            "pages_used_by_rank": [
                pool.allocator.part_pages - pool.allocator.free_in(p)
                for p in range(pool.allocator.parts)
            ],
            # Per-request state slots (DeepSeek-V4; kvcache/state_pool.py), 0 without.
            "state_slots": pool.state.num_slots if pool.state is not None else 0,
            "state_slots_free": pool.state.num_free if pool.state is not None else 0,
            "leases": len(leases) - (1 if cache is not None else 0),
            "lease_violations": violations,
            "layout": pool.layout.to_dict(),
        },
        "prefix_cache": cache.snapshot() if cache is not None else None,
        "requests": [request_row(r, now) for r in requests],
    }


def overdue(
    late: float, now: float, requests: Sequence[Request], rooms: Sequence[Room]
) -> tuple[str, ...]:
    """What is still here past its deadline before `late` (monotonic): a deadline that did not
    end it, which /health reports."""
    return tuple(
        [
            f"request {r.request_id} ({r.status.value}) {now - r.deadline:.1f}s past deadline"
            for r in requests
            if r.deadline is not None and r.deadline < late
        ]
        + [
            f"room {room.room} ({room.state.value}) {now - room.deadline:.1f}s past deadline"
            for room in rooms
            if room.deadline < late
        ]
    )
