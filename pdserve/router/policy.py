"""Selection policies: which worker of a pool gets the next request.

Pure and deterministic: a policy sees the candidates that are in rotation (each with its
stable registry index and its outstanding request count) and returns one of them. Ties
rotate: with sequential traffic every worker is idle at pick time, and a policy that broke
ties by position would pin the whole load onto the first worker.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, Protocol, TypeVar


class Candidate(Protocol):
    index: int  # position in the registry; stable for the router's lifetime
    outstanding: int  # requests routed to it that have not finished yet


C = TypeVar("C", bound=Candidate)


class Policy(ABC):
    name: ClassVar[str]

    def __init__(self) -> None:
        self._last: dict[str, int] = {}  # pool -> index of the worker chosen last

    def choose(self, pool: str, candidates: Sequence[C]) -> C:
        """One of `candidates` (non-empty) for the next request of `pool`."""
        if not candidates:
            raise ValueError(f"policy {self.name}: no {pool} candidates to choose from")
        chosen = self._pick(pool, candidates)
        self._last[pool] = chosen.index
        return chosen

    @abstractmethod
    def _pick(self, pool: str, candidates: Sequence[C]) -> C: ...

    def _next_in_turn(self, pool: str, candidates: Sequence[C]) -> C:
        """The first candidate after the last chosen one, by registry index, wrapping."""
        last = self._last.get(pool, -1)
        later = [c for c in candidates if c.index > last]
        return min(later or candidates, key=lambda c: c.index)


class RoundRobin(Policy):
    name = "round-robin"

    def _pick(self, pool: str, candidates: Sequence[C]) -> C:
        return self._next_in_turn(pool, candidates)


class LeastOutstanding(Policy):
    name = "least-outstanding"

    def _pick(self, pool: str, candidates: Sequence[C]) -> C:
        least = min(c.outstanding for c in candidates)
        return self._next_in_turn(pool, [c for c in candidates if c.outstanding == least])


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastOutstanding)}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(sorted(POLICIES))}") from None
