"""The prefill role's KV writes: each room's computed pages posted to its decode worker, polled.

After a step, the pages its chunks filled are written to each room's destination pages (with the
prompt's last pages, its state slot's pages into D's slot, for a model with per-request state),
one write a room, through the writer of the decode worker that sent the room (its current
pairing only: worker/prefill/peers.py). On a GPU every write waits for the step's end (one event
a step), so no transfer reads KV still being computed. A write stays in `room.inflight` until it
completes; meanwhile the scheduler never preempts the request, and a room in WAITING_FOR_WRITES
waits for it before PrefillDone (or its failure) goes out. A write that fails fails its room,
never the step; one whose peer's transfer layer disconnected (PeerGone) drops that peer, failing
every room it had at once. Room events go back to the prefill role (worker/prefill/role.py),
which owns the rooms, through `apply` and `drop_peer`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from pdserve.engine.request import Request
from pdserve.engine.scheduler import StepPlan
from pdserve.kvcache.pool import KVPool
from pdserve.kvcache.rank_pages import RankPages
from pdserve.protocol.rooms import PEvent, PState
from pdserve.runtime.faults import FAULTS
from pdserve.transfer.dataplane import PeerGone, WriteError, step_done
from pdserve.worker.pd_role import RoleStats
from pdserve.worker.prefill.peers import DecodePeer, DecodePeers
from pdserve.worker.prefill.rooms import PRoom

log = logging.getLogger(__name__)

WAITING_FOR_WRITES = (PState.WRITING, PState.ABORTING, PState.FAILING)


class PrefillWrites:
    def __init__(
        self,
        pool: KVPool,
        pages: RankPages,
        peers: DecodePeers,
        stats: RoleStats,
        apply: Callable[[PRoom, PEvent, float, str], None],
        drop_peer: Callable[[DecodePeer, str, float], None],
    ) -> None:
        """`pool`: rank 0's (its pages and sizes); `pages`: what is written, every rank's
        as the whole model's; `apply(room, event, now, reason)`: a room event (WRITE_FAILED,
        WRITES_DONE) for the role's room machine; `drop_peer(peer, why, now)`: its transfer
        layer disconnected."""
        self.pool = pool
        self.pages = pages
        self.peers = peers
        self.stats = stats
        self.apply = apply
        self.drop_peer = drop_peer
        # Peers whose transfer layer disconnected, found by a poll that may not drop them
        # (mid-step: dropping fails rooms still in the batch): (peer, registration) -> why.
        self.gone: dict[tuple[str, int], str] = {}

    def post(self, plan: StepPlan, rooms: Mapping[str, PRoom], now: float, wall: float) -> None:
        """Post writes of the pages this step completed, for each of `rooms` (by request id)
        still prefilling; on a GPU each waits for the step's end (one event per step). `now`,
        `wall`: one reading of the monotonic and the wall clock (write deadlines are wall-clock
        time, the transfer layer's monotonic)."""
        ready = step_done(self.pool) if plan.chunks else None
        for c in plan.chunks:
            room = rooms.get(c.request.request_id)
            if room is None or room.state is not PState.PREFILLING:
                continue
            req = c.request
            done = req.num_computed >= len(req.prompt_ids)
            target = (
                self.pool.pages_needed(len(req.prompt_ids))
                if done
                else (req.num_computed // self.pool.page_size)
            )
            # Per-request state (DeepSeek-V4): once, with the prompt's last pages.
            state = self._state_pages(req) if done and room.state_pages else []
            if target <= room.pages_written and not state:
                continue
            peer = self.peers.current(room.peer, room.peer_generation)
            try:
                if peer is None:
                    raise WriteError(f"decode worker {room.peer} is no longer registered")
                if wall > room.write_deadline:
                    raise WriteError("the room's write deadline passed (its pages may be reused)")
                FAULTS.hit("p.write")
                sl = slice(room.pages_written, target)
                xfer = peer.writer.write(
                    room.room,
                    room.epoch,
                    self.pages,
                    [*req.pages[sl], *state],
                    [*room.dst_pages[sl], *(room.state_pages if state else ())],
                    room.write_deadline_mono(now, wall),
                    ready,
                )
                room.inflight.append(xfer)
                room.bytes_written += xfer.nbytes
                room.state_bytes += len(state) * self.pages.page_bytes
                room.pages_written = target
            except PeerGone as e:
                assert peer is not None  # PeerGone comes from peer.writer; not input-dependent
                self.drop_peer(peer, f"its transfer layer disconnected ({e})", now)
            except Exception as e:  # noqa: BLE001 - any write failure fails this room, not the step
                log.warning("KV write for room %d failed: %s", room.room, e)
                self.apply(room, PEvent.WRITE_FAILED, now, f"KV write failed: {e}")

    def _state_pages(self, req: Request) -> list[int]:
        """The pages of `req`'s state slot in our pool (none without per-request state)."""
        slot = req.lease.slot if req.lease is not None else None
        if self.pool.state is None or slot is None:
            return []
        first = self.pool.state.first_page(slot)
        return list(range(first, first + self.pool.state.pages_each))

    def poll(self, rooms: Iterable[PRoom], now: float, drop_peers: bool = True) -> None:
        """Collect completed writes of `rooms`; a failed or overdue one fails its room. A peer
        whose transfer layer disconnected is dropped, or with `drop_peers` False only noted,
        for the next poll that may drop it."""
        gone = self.gone  # (peer, registration) -> what NIXL said
        for room in [r for r in rooms if r.inflight]:
            error = None
            for xfer in list(room.inflight):
                try:
                    if not xfer.poll():
                        continue
                    self.stats.bytes_written += xfer.nbytes
                except PeerGone as e:
                    gone.setdefault((room.peer, room.peer_generation), str(e))
                    room.writes_cancelled, error = True, str(e)
                except WriteError as e:
                    room.writes_cancelled, error = True, str(e)
                room.inflight.remove(xfer)
            if error is not None:
                log.warning("KV write for room %d failed: %s", room.room, error)
                self.apply(room, PEvent.WRITE_FAILED, now, f"KV write failed: {error}")
            if not room.inflight and room.state in WAITING_FOR_WRITES:
                self.apply(room, PEvent.WRITES_DONE, now, "")
        while drop_peers and gone:  # one at a time: should a drop raise, the rest stay noted
            (peer_id, generation), why = gone.popitem()
            peer = self.peers.current(peer_id, generation)  # not a former pairing's
            if peer is not None:
                self.drop_peer(peer, f"its transfer layer disconnected ({why})", now)
