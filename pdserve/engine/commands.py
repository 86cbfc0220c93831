"""The engine's own inbox commands (roles add theirs: a peer's message, a failed send).

Other threads reach the engine only through its inbox (docs/architecture.md §Threads); these
are what `Engine.submit`, `abort` and `snapshot` put there.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pdserve.engine.request import Request


@dataclass(frozen=True)
class SubmitCommand:
    request: Request
    prefill: str | None = None  # a prefill worker's control address: the decode role's request


@dataclass(frozen=True)
class AbortCommand:
    request_id: str


@dataclass(frozen=True)
class SnapshotQuery:
    reply: Future[dict[str, Any]]


Command = SubmitCommand | AbortCommand | SnapshotQuery
