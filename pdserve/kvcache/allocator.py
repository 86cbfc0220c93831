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

Parts (data-parallel attention, `--dp N`): the pages may be split into `parts` equal ranges, part
r being rank r's pool (pages r * part_pages ..). Each part has its own free list and evictable
count; `allocate` and `can_allocate` take the part, and `evict` is asked for that part's pages.
A request's pages are all in one part (kvcache/lease.py `Lease.part`). One part, the default, is
the whole pool, and nothing else changes.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Sequence


class PageAllocError(RuntimeError):
    """A local bookkeeping error: a double release, a release of a free page, over-allocation."""


class PageAllocator:
    def __init__(self, num_pages: int, parts: int = 1) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if parts < 1 or num_pages % parts:
            raise ValueError(f"{num_pages} pages do not split into {parts} equal parts")
        self.num_pages = num_pages
        self.parts = parts
        self.part_pages = num_pages // parts
        pp = self.part_pages
        # Each part's free pages, a heap (sorted is a heap).
        self._free: list[list[int]] = [list(range(r * pp, (r + 1) * pp)) for r in range(parts)]
        self._refs: list[int] = [0] * num_pages
        self._cached: set[int] = set()  # pages the prefix cache holds a reference on
        # Per part, cached pages whose count is 1: only the cache holds them.
        self._evictable = [0] * parts
        # Frees at least `n` evictable pages of a part (PrefixCache.evict); None: no cache.
        self.evict: Callable[[int, int], object] | None = None

    @property
    def num_free(self) -> int:
        return sum(len(f) for f in self._free)

    @property
    def num_used(self) -> int:
        """Pages with at least one reference (a shared page counts once)."""
        return self.num_pages - self.num_free

    @property
    def num_evictable(self) -> int:
        """Pages only the prefix cache holds: in use, but `allocate` can have them."""
        return sum(self._evictable)

    def part_of(self, page: int) -> int:
        """The part (data-parallel rank) whose pool holds `page`."""
        self._check_range(page, "placed")
        return page // self.part_pages

    def free_in(self, part: int) -> int:
        """Free pages of `part`."""
        self._check_part(part)
        return len(self._free[part])

    def available(self, part: int = 0) -> int:
        """Pages `allocate` can hand out in `part`: free, or only cached."""
        self._check_part(part)
        return len(self._free[part]) + self._evictable[part]

    @property
    def num_held(self) -> int:
        """Pages a request or room holds (in use and not only cached): 0 when quiet."""
        return self.num_used - self.num_evictable

    def can_allocate(self, n: int, part: int = 0) -> bool:
        return n <= self.available(part)

    def roomiest(self, n: int) -> int | None:
        """The part with the most pages to give, if it can give `n` (the lowest of equals);
        None if none can: where a holder that is not a scheduled request (a decode room) goes."""
        part = max(range(self.parts), key=lambda p: (self.available(p), -p))
        return part if self.can_allocate(n, part) else None

    def refcount(self, page: int) -> int:
        self._check_range(page, "read")
        return self._refs[page]

    def allocate(self, n: int, part: int = 0) -> list[int]:
        """The `n` lowest free pages of `part`, ascending, each with reference count 1."""
        if n < 0:
            raise PageAllocError(f"asked for {n} pages")
        self._check_part(part)
        free = self._free[part]
        if n > len(free) and self.evict is not None and self.can_allocate(n, part):
            self.evict(n - len(free), part)
        if n > len(free):
            where = f" in part {part}" if self.parts > 1 else ""
            raise PageAllocError(f"asked for {n} pages, {len(free)} free{where}")
        pages = [heapq.heappop(free) for _ in range(n)]
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
                self._evictable[p // self.part_pages] -= 1

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
                self._evictable[p // self.part_pages] += 1 if self._refs[p] == 1 else -1
            if self._refs[p] == 0:
                heapq.heappush(self._free[p // self.part_pages], p)

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
                self._evictable[p // self.part_pages] += 1 if cached else -1

    def violations(self) -> list[str]:
        """The allocator's own consistency (for /debug/invariants): the free list holds each
        page with count 0 exactly once, and nothing else. O(num_pages)."""
        out = []
        in_free = Counter(p for free in self._free for p in free)
        for r, free in enumerate(self._free):
            strays = [p for p in free if p // self.part_pages != r]
            if strays:
                out.append(f"part {r}'s free list holds other parts' pages {strays[:5]}")
        for p in range(self.num_pages):
            listed, refs = in_free.get(p, 0), self._refs[p]
            if refs < 0 or listed != (1 if refs == 0 else 0):
                out.append(f"page {p}: refcount {refs}, in the free list {listed} times")
        evictable = [0] * self.parts
        for p in self._cached:
            if self._refs[p] == 1:
                evictable[p // self.part_pages] += 1
        if evictable != self._evictable:
            out.append(f"evictable pages by part: counted {self._evictable}, found {evictable}")
        return out

    def _check_part(self, part: int) -> None:
        if not 0 <= part < self.parts:
            raise PageAllocError(f"part {part} of a pool in {self.parts} part(s)")

    def _check_range(self, page: int, verb: str) -> None:
        if not 0 <= page < self.num_pages:
            raise PageAllocError(
                f"page {page} {verb} but the pool has pages 0..{self.num_pages - 1}"
            )
