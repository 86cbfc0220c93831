"""Page allocator: which pages of the pool are free, and how many references each other has.

Invariant: a page is in the free list exactly when its reference count is 0. `allocate` hands
out pages with count 1, `retain` adds a reference to a page someone holds (a shared prefix),
`release` drops one, and a page whose count reaches 0 goes back to the free list. Every verb
checks all its pages before it changes anything, so a double release or a release of a free
page is a loud error at the call site, with nothing half done, not silent KV corruption later.
Who holds the references is kvcache/lease.py's business; this file only counts them.

Cached pages (kvcache/prefix_cache.py): a page marked `cached` whose only reference is the
cache's is *evictable*; the allocator keeps their number as counts change, so `can_allocate`
counts them as available, and `allocate` asks its `evict` hook for them when the free list is
short. Pages anyone else holds are never evicted.

Order: `allocate` hands out the lowest free pages, ascending (the free list is a heap). A
request's pages are then consecutive whenever the low end of the pool has a long enough free
run, always on a quiet pool, and fall into a few runs under churn (benchmarks/transfer/transfer.py's
churn: 128 pages in a median of 22 runs; a FIFO list, which queues freed pages at the back,
gave 128). Pages consecutive on both sides of a KV transfer move as one NIXL descriptor
instead of one per page (transfer/nixl.py).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Sequence


class PageAllocError(RuntimeError):
    """A local bookkeeping error: a double release, a release of a free page, over-allocation."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages))  # a heap; sorted is a heap
        self._refs: list[int] = [0] * num_pages
        self._cached: set[int] = set()  # pages the prefix cache holds a reference on
        self._evictable = 0  # cached pages whose count is 1: only the cache holds them
        # Frees at least `n` evictable pages (PrefixCache.evict); None: nothing is cached.
        self.evict: Callable[[int], object] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages with at least one reference (a shared page counts once)."""
        return self.num_pages - len(self._free)

    @property
    def num_evictable(self) -> int:
        """Pages only the prefix cache holds: in use, but `allocate` can have them."""
        return self._evictable

    @property
    def num_held(self) -> int:
        """Pages a request or room holds (in use and not only cached): 0 when quiet."""
        return self.num_used - self._evictable

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free) + self._evictable

    def refcount(self, page: int) -> int:
        self._check_range(page, "read")
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        """The `n` lowest free pages, ascending, each with reference count 1."""
        if n < 0:
            raise PageAllocError(f"asked for {n} pages")
        if n > len(self._free) and self.evict is not None and self.can_allocate(n):
            self.evict(n - len(self._free))
        if n > len(self._free):
            raise PageAllocError(f"asked for {n} pages, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def retain(self, pages: Sequence[int]) -> None:
        """One more reference on each page; every one must already be held (count > 0)."""
        for p in pages:
            self._check_range(p, "retained")
            if self._refs[p] == 0:
                raise PageAllocError(f"page {p} retained but it is free")
        for p in pages:
            self._refs[p] += 1
            if self._refs[p] == 2 and p in self._cached:
                self._evictable -= 1

    def release(self, pages: Sequence[int]) -> None:
        """One reference less on each page (a page listed twice loses two); a page left with
        none is free again."""
        for p, times in Counter(pages).items():
            self._check_range(p, "released")
            if self._refs[p] == 0:
                raise PageAllocError(f"page {p} released but it is free")
            if times > self._refs[p]:
                raise PageAllocError(
                    f"page {p} released {times} times but it has {self._refs[p]} references"
                )
        for p in pages:
            self._refs[p] -= 1
            if p in self._cached and self._refs[p] < 2:
                self._evictable += 1 if self._refs[p] == 1 else -1
            if self._refs[p] == 0:
                heapq.heappush(self._free, p)

    def mark_cached(self, pages: Sequence[int], cached: bool) -> None:
        """The prefix cache took (True, after its reference) or dropped (False, after its
        reference went) its reference on `pages`: the evictable count follows."""
        for p in pages:
            self._check_range(p, "marked")
            if (p in self._cached) == cached:
                raise PageAllocError(f"page {p} marked cached={cached} twice")
            if cached and self._refs[p] == 0:
                raise PageAllocError(f"page {p} marked cached but it is free")
        for p in pages:
            if cached:
                self._cached.add(p)
            else:
                self._cached.discard(p)
            if self._refs[p] == 1:
                self._evictable += 1 if cached else -1

    def violations(self) -> list[str]:
        """The allocator's own consistency (for /debug/invariants): the free list holds each
        page with count 0 exactly once, and nothing else. O(num_pages)."""
        out = []
        in_free = Counter(self._free)
        for p in range(self.num_pages):
            listed, refs = in_free.get(p, 0), self._refs[p]
            if refs < 0 or listed != (1 if refs == 0 else 0):
                out.append(f"page {p}: refcount {refs}, in the free list {listed} times")
        evictable = sum(1 for p in self._cached if self._refs[p] == 1)
        if evictable != self._evictable:
            out.append(f"evictable pages: counted {self._evictable}, found {evictable}")
        return out

    def _check_range(self, page: int, verb: str) -> None:
        if not 0 <= page < self.num_pages:
            raise PageAllocError(
                f"page {page} {verb} but the pool has pages 0..{self.num_pages - 1}"
            )
