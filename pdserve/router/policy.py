"""Selection policies: which worker of a pool gets the next request.

Pure and deterministic: a policy sees the candidates that are in rotation (each with its
stable registry index and its outstanding request count) and returns one of them. Ties
rotate: with sequential traffic every worker is idle at pick time, and a policy that broke
ties by position would pin the whole load onto the first worker.

`prefix` (cache-aware) also sees the prompt's token ids, for the pool whose workers hold the
prefix cache (co-located workers, or prefill workers in PD; the registry decides which pool
gets the prompt). It keeps a `PrefixIndex` per worker of the prompts it sent there and sends
the next prompt where the longest prefix of it should be cached, unless that worker has more
than `max_imbalance` requests in flight beyond the least loaded candidate: then the least
loaded wins, and its index learns the new placement.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from pdserve.protocol.page_keys import page_keys
from pdserve.router.prefix_index import DEFAULT_CAPACITY_PAGES, DEFAULT_PAGE_SIZE, PrefixIndex


class Candidate(Protocol):
    index: int  # position in the registry; stable for the router's lifetime
    outstanding: int  # requests routed to it that have not finished yet


C = TypeVar("C", bound=Candidate)
NO_PROMPT: tuple[int, ...] = ()


class Policy(ABC):
    name: ClassVar[str]

    def __init__(self) -> None:
        self._last: dict[str, int] = {}  # pool -> index of the worker chosen last

    def choose(self, pool: str, candidates: Sequence[C], prompt: Sequence[int] = NO_PROMPT) -> C:
        """One of `candidates` (non-empty) for the next request of `pool`; `prompt` is given
        only for the pool whose workers keep the prefix cache."""
        if not candidates:
            raise ValueError(f"policy {self.name}: no {pool} candidates to choose from")
        chosen = self._pick(pool, candidates, prompt)
        self._last[pool] = chosen.index
        return chosen

    def forget(self, pool: str, index: int) -> None:
        """Worker `index` of `pool` left rotation: whatever the policy knew of it is stale.
        The load-only policies know nothing of a worker beyond this call."""
        return None

    def state(self, pool: str, index: int) -> dict[str, Any]:
        """What the policy knows of one worker, for /debug/cluster."""
        return {}

    def stats(self) -> dict[str, Any]:
        """The policy's own counters, for /debug/cluster."""
        return {}

    @abstractmethod
    def _pick(self, pool: str, candidates: Sequence[C], prompt: Sequence[int]) -> C: ...

    def _next_in_turn(self, pool: str, candidates: Sequence[C]) -> C:
        """The first candidate after the last chosen one, by registry index, wrapping."""
        last = self._last.get(pool, -1)
        later = [c for c in candidates if c.index > last]
        return min(later or candidates, key=lambda c: c.index)

    def _least_outstanding(self, pool: str, candidates: Sequence[C]) -> C:
        least = min(c.outstanding for c in candidates)
        return self._next_in_turn(pool, [c for c in candidates if c.outstanding == least])


class RoundRobin(Policy):
    name = "round-robin"

    def _pick(self, pool: str, candidates: Sequence[C], prompt: Sequence[int]) -> C:
        return self._next_in_turn(pool, candidates)


class LeastOutstanding(Policy):
    name = "least-outstanding"

    def _pick(self, pool: str, candidates: Sequence[C], prompt: Sequence[int]) -> C:
        return self._least_outstanding(pool, candidates)


@dataclass(frozen=True)
class PrefixSettings:
    page_size: int = DEFAULT_PAGE_SIZE  # the cache-holding workers' (from their /info)
    index_pages: int = DEFAULT_CAPACITY_PAGES  # page keys remembered per worker
    max_imbalance: int = 8  # requests in flight beyond the least loaded a cache hit may cost

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.index_pages < 1 or self.max_imbalance < 0:
            raise ValueError(
                f"prefix routing needs page_size >= 1, index_pages >= 1 and "
                f"max_imbalance >= 0, got {self}"
            )


@dataclass
class PrefixStats:
    by_prefix: int = 0  # routed to the candidate with the longest expected match
    by_load: int = 0  # a match existed but its worker was too busy: least-outstanding won
    no_match: int = 0  # nobody was expected to hold any page of the prompt
    no_prompt: int = 0  # a pool without the cache, or an empty prompt: least-outstanding


class PrefixAware(Policy):
    name = "prefix"

    def __init__(self, settings: PrefixSettings | None = None) -> None:
        super().__init__()
        self.settings = settings or PrefixSettings()
        self.counts = PrefixStats()
        self._indexes: dict[tuple[str, int], PrefixIndex] = {}

    def _index(self, pool: str, index: int) -> PrefixIndex:
        key = (pool, index)
        if key not in self._indexes:
            self._indexes[key] = PrefixIndex(self.settings.index_pages)
        return self._indexes[key]

    def expected_match(self, pool: str, index: int, prompt: Sequence[int]) -> int:
        """Pages of `prompt` that worker `index` of `pool` is expected to hold."""
        idx = self._indexes.get((pool, index))
        return 0 if idx is None else idx.match(page_keys(prompt, self.settings.page_size))

    def _pick(self, pool: str, candidates: Sequence[C], prompt: Sequence[int]) -> C:
        keys = page_keys(prompt, self.settings.page_size)
        if not keys:
            self.counts.no_prompt += 1
            return self._least_outstanding(pool, candidates)
        matches = [self._index(pool, c.index).match(keys) for c in candidates]
        best = max(matches)
        if best == 0:
            self.counts.no_match += 1
            chosen = self._least_outstanding(pool, candidates)
        else:
            holders = [c for c, m in zip(candidates, matches, strict=True) if m == best]
            chosen = self._least_outstanding(pool, holders)
            least = min(c.outstanding for c in candidates)
            if chosen.outstanding > least + self.settings.max_imbalance:
                self.counts.by_load += 1
                chosen = self._least_outstanding(pool, candidates)
            else:
                self.counts.by_prefix += 1
        self._index(pool, chosen.index).insert(keys)
        return chosen

    def forget(self, pool: str, index: int) -> None:
        self._indexes.pop((pool, index), None)

    def state(self, pool: str, index: int) -> dict[str, Any]:
        idx = self._indexes.get((pool, index))
        return {"prefix_index_pages": 0 if idx is None else len(idx)}

    def stats(self) -> dict[str, Any]:
        return {
            "routed": vars(self.counts).copy(),
            "page_size": self.settings.page_size,
            "index_pages": self.settings.index_pages,
            "max_imbalance": self.settings.max_imbalance,
        }


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastOutstanding, PrefixAware)}


def make_policy(name: str, prefix: PrefixSettings | None = None) -> Policy:
    """The policy called `name`; `prefix` configures the `prefix` policy (else defaults)."""
    if name == PrefixAware.name:
        return PrefixAware(prefix)
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(sorted(POLICIES))}") from None
