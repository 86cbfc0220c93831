"""Page allocator: which pages of the pool are free, and who holds the others.

Invariant: every page is either in the free list or owned by exactly one holder. `free`
refuses a page that is already free or held by someone else, so a double free or a free by
the wrong owner is a loud error at the call site, not silent KV corruption later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence


class PageAllocError(RuntimeError):
    """A local bookkeeping error: double free, foreign free, or over-allocation."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._owner: dict[int, Hashable] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, owner: Hashable) -> list[int]:
        if n > len(self._free):
            raise PageAllocError(f"asked for {n} pages, {len(self._free)} free (owner {owner!r})")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._owner[p] = owner
        return pages

    def free(self, pages: Sequence[int], owner: Hashable) -> None:
        for p in pages:
            held_by = self._owner.get(p)
            if held_by is None:
                raise PageAllocError(f"page {p} freed by {owner!r} but it is not allocated")
            if held_by != owner:
                raise PageAllocError(f"page {p} freed by {owner!r} but held by {held_by!r}")
        for p in pages:
            del self._owner[p]
            self._free.append(p)

    def owners(self) -> dict[Hashable, int]:
        """Pages held per owner (for /debug/state and invariant checks)."""
        counts: dict[Hashable, int] = {}
        for o in self._owner.values():
            counts[o] = counts.get(o, 0) + 1
        return counts
