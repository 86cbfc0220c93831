"""Loads from the host tier: host pages copied back into device pages before a request prefills.

A load belongs to one waiting request. Its device pages are held by a lease of its own (owner
"host load <request id>") and its host pages are pinned (HostPool.pin), both until the copy
ended, so nothing reuses a page the copy writes or reads. `poll` reports each load once:

- LOADED: the scheduler shares the pages into the request's lease, then `end`s the load.
- FAILED (the copy failed) or TIMED_OUT (still running HOST_LOAD_TIMEOUT_S after it started):
  the request computes those tokens instead, and its pages are never used; the load is
  abandoned.

An abandoned load (also: its request aborted, failed or expired while loading) keeps its
pages until its copy ended, then gives them back (`reap`, each poll): freeing a page a copy
may still write would hand someone else wrong KV (LESSONS #7). A copy that never ends keeps
its pages out of use for good, which `/debug/invariants` shows as a live lease. Engine-thread
only.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.kvcache.host_copier import Copy, CopyState, Finished
from pdserve.kvcache.host_pool import HostPool
from pdserve.kvcache.lease import Lease, Leases
from pdserve.runtime import timing

log = logging.getLogger(__name__)


class Outcome(enum.Enum):
    LOADED = "loaded"
    FAILED = "failed"
    TIMED_OUT = "timed out"


@dataclass
class Load:
    request_id: str
    lease: Lease  # the device pages the copy writes, in token order
    keys: list[int]  # the chain keys of the pages loaded
    host_pages: list[int]  # pinned until the copy ended
    copy: Copy
    deadline: float  # monotonic


class HostLoads:
    def __init__(
        self,
        host: HostPool,
        leases: Leases,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.host = host
        self.leases = leases
        self.clock = clock
        self.active: dict[str, Load] = {}  # by request id
        self.abandoned: list[Load] = []  # their copies may still run

    def loading(self, request_id: str) -> bool:
        return request_id in self.active

    def start(self, request_id: str, keys: list[int], host_pages: list[int]) -> Load | None:
        """Copy pinned `host_pages` into fresh device pages; None (the pages unpinned) if the
        device has no room for them or the request has a load already."""
        n = len(host_pages)
        if request_id in self.active or not self.leases.allocator.can_allocate(n):
            self.host.unpin(host_pages)
            return None
        lease = self.leases.open(f"host load {request_id}", n)
        copy: Copy
        try:
            copy = self.host.load(host_pages, lease.pages)
        except Exception as e:  # noqa: BLE001 - a copy that cannot start: recompute instead
            log.warning("loading %d pages from the host cache failed: %s", n, e)
            copy = Finished(ok=False)
        deadline = self.clock() + timing.HOST_LOAD_TIMEOUT_S
        load = Load(request_id, lease, keys, list(host_pages), copy, deadline)
        self.active[request_id] = load
        return load

    def poll(self) -> list[tuple[Load, Outcome]]:
        """Loads that ended (or timed out) since the last poll, each reported once; a LOADED
        one stays the caller's to `end`, the others are abandoned here."""
        self.reap()
        now = self.clock()
        out: list[tuple[Load, Outcome]] = []
        for rid, load in list(self.active.items()):
            state = load.copy.state()
            if state is CopyState.PENDING and now <= load.deadline:
                continue
            del self.active[rid]
            if state is CopyState.DONE:
                out.append((load, Outcome.LOADED))
                continue
            out.append((load, Outcome.FAILED if state is CopyState.FAILED else Outcome.TIMED_OUT))
            self._abandon(load)
            if state is CopyState.FAILED:
                self.host.forget(load.keys)  # its bytes are suspect
        return out

    def end(self, load: Load) -> None:
        """A LOADED load whose pages the request now shares: drop the load's references."""
        load.lease.release()
        self.host.unpin(load.host_pages)

    def abandon(self, request_id: str) -> None:
        """Its request left while loading: the pages go back once the copy ended."""
        load = self.active.pop(request_id, None)
        if load is not None:
            self._abandon(load)

    def _abandon(self, load: Load) -> None:
        if load.copy.state() is CopyState.PENDING:
            self.abandoned.append(load)
        else:
            self.end(load)

    def reap(self) -> int:
        """Give back the pages of abandoned loads whose copies ended; returns how many."""
        done = [ld for ld in self.abandoned if ld.copy.state() is not CopyState.PENDING]
        for load in done:
            self.abandoned.remove(load)
            self.end(load)
        return len(done)

    def has_work(self) -> bool:
        """Loads to poll: an active one, or an abandoned one within its deadline (past it,
        one is still reaped at every poll, but does not keep the engine loop spinning)."""
        now = self.clock()
        return bool(self.active) or any(now <= ld.deadline for ld in self.abandoned)

    def violations(self) -> list[str]:
        """Every load's lease is live and its host pages are exactly the host pool's pins."""
        out: list[str] = []
        pins: dict[int, int] = {}
        for load in [*self.active.values(), *self.abandoned]:
            if not load.lease.live:
                out.append(f"host load of {load.request_id}: its lease is {load.lease.state.value}")
            for p in load.host_pages:
                pins[p] = pins.get(p, 0) + 1
        if pins != dict(self.host.pins):
            out.append(f"host pins {dict(self.host.pins)} but loads read {pins}")
        return out

    def snapshot(self) -> dict[str, Any]:
        return {"loads_in_flight": len(self.active), "loads_abandoned": len(self.abandoned)}
