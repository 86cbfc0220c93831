"""Bits shared by the prefill and decode roles: counters, inbox events, the pages they move."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.engine.role import RoleHost
from pdserve.kvcache.rank_pages import RankPages
from pdserve.protocol.messages import Msg
from pdserve.protocol.rooms import Outcome


def pd_pages(engine: RoleHost) -> RankPages:
    """The whole model's pages a PD role moves; an engine at TP > 1 has them only when built
    for a PD role (Engine.build's `pd`)."""
    if engine.pages is None:
        raise ValueError("a PD role at --tp > 1 needs an engine built with pd=True")
    return engine.pages


@dataclass(frozen=True)
class SendFailed:
    """The control plane could not send `msg` to `peer` (queue full, peer unreachable)."""

    peer: str
    msg: Msg
    why: str


@dataclass
class RoleStats:
    stale: Counter[str] = field(default_factory=Counter)  # events that did not apply
    unexpected: Counter[str] = field(default_factory=Counter)  # messages this role never takes
    send_failed: int = 0
    rejected: int = 0
    done: int = 0
    failed: int = 0
    aborted: int = 0
    bytes_written: int = 0  # P: bytes whose writes completed; D (tcp, nixl): bytes received
    bytes_acked: int = 0  # in PrefillDone: P, bytes it reported; D, bytes it decoded on
    peers_dropped: Counter[str] = field(default_factory=Counter)  # P: by why (silent, disconnected)

    def snapshot(self) -> dict[str, object]:
        return {
            "stale": dict(self.stale),
            "unexpected": dict(self.unexpected),
            "send_failed": self.send_failed,
            "rejected": self.rejected,
            "done": self.done,
            "failed": self.failed,
            "aborted": self.aborted,
            "bytes_written": self.bytes_written,
            "bytes_acked": self.bytes_acked,
            "peers_dropped": dict(self.peers_dropped),
        }


class Room(Protocol):
    state: Any
    since: float
    reason: str


def enter(room: Room, out: Outcome, event: str, reason: str, stats: RoleStats, now: float) -> bool:
    """Record a table outcome on a room as of `now` (monotonic); a stale event is counted and
    changes nothing."""
    if out.stale:
        stats.stale[event] += 1
        return False
    room.state = out.state
    room.since = now
    room.reason = room.reason or reason
    return True
