"""Page leases: who holds the references the allocator counts, each lease ended in one place.

A `Lease` is one holder's references on pages. A request's page table, a decode room's
destination pages and the source pages a prefill room keeps while its writes read them are held
in token order; the prefix cache's pages have none. `Leases.open` starts one; `extend` adds
fresh pages, `share` takes references on pages other leases hold (a cached prefix) and `drop`
gives some back (the cache evicting) in O(pages dropped), not O(pages held): a 2-page drop
from 32,768 cached pages took 817 us when it rebuilt the list, 9 us now
(benchmarks/engine/lease_drop.py).
A lease ends exactly once: `release()` drops every reference, or `hand_over(owner)` moves them,
counts unchanged, to a new lease (a room that outlives its request, a request that inherits
its room's pages). A lease used after it ended raises LeaseError, so a double release is a
loud error, never a second decrement.

A lease is in one part of a pool split for data-parallel attention (kvcache/allocator.py):
`Lease.part`, the rank whose pool its pages are in; `extend` allocates there, and `share`
refuses a page of another part. The prefix cache's lease, whose pages are in every part, has
part None and never extends. An unsplit pool has one part, 0.

A lease may also hold one per-request state slot (kvcache/state_pool.py, DeepSeek-V4): `take_slot`
gives it one, and it goes wherever the pages go, back to the state pool on `release` or to the
heir on `hand_over`, so a request's state lives and dies with its pages.

Invariant (`Leases.violations`, checked by /debug/invariants): every page's reference count
equals the number of live leases holding it; so a free page has count 0 and no lease holds it.
Engine-thread only, like the allocator under it.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence

from pdserve.kvcache.allocator import PageAllocator, PageAllocError
from pdserve.kvcache.state_pool import StatePool

VIOLATIONS_LISTED = 20  # a corrupted pool could list every page; say how many more instead


class LeaseError(PageAllocError):
    """A lease used after it ended, or asked to share a page twice."""


class LeaseState(enum.Enum):
    LIVE = "live"
    RELEASED = "released"
    HANDED_OVER = "handed over"


class Lease:
    """One owner's references on pages. Open it with `Leases.open`."""

    def __init__(
        self,
        registry: Leases,
        owner: Hashable,
        pages: list[int],
        slot: int | None = None,
        part: int | None = 0,
    ) -> None:
        self.owner = owner
        self.slot = slot  # its state slot, if it holds one
        self.part = part  # the pool part its pages are in (None: any, the prefix cache's)
        self.state = LeaseState.LIVE
        self.heir: Hashable | None = None  # whom it was handed over to
        self._registry = registry
        self._pages = pages
        self._held = set(pages)  # the same pages, for O(1) checks (the cache's lease is big)
        self._index: dict[int, int] | None = None  # page -> position in _pages, once dropped

    def __repr__(self) -> str:
        return f"Lease({self.owner!r}, {len(self._pages)} pages, {self.state.value})"

    @property
    def pages(self) -> Sequence[int]:
        """The pages in the order they were added, until a `drop` (a view: it grows with the
        lease)."""
        return self._pages

    def __len__(self) -> int:
        return len(self._pages)

    @property
    def live(self) -> bool:
        return self.state is LeaseState.LIVE

    def extend(self, n: int) -> list[int]:
        """`n` fresh pages (count 1) appended; PageAllocError, and nothing taken, if fewer are
        free."""
        self._check_live("extend")
        if self.part is None:
            raise LeaseError(f"lease of {self.owner!r} holds pages of every part: it never extends")
        new = self._registry.allocator.allocate(n, self.part)
        self._append(new)
        return new

    def take_slot(self) -> int:
        """A state slot from the registry's state pool, held until the lease ends; LeaseError
        if it holds one already or the pool has none, SlotError if every slot is taken."""
        self._check_live("take a state slot")
        if self.slot is not None:
            raise LeaseError(f"lease of {self.owner!r} holds state slot {self.slot} already")
        if self._registry.slots is None:
            raise LeaseError(f"lease of {self.owner!r}: this pool keeps no per-request state")
        self.slot = self._registry.slots.take()
        return self.slot

    def share(self, pages: Sequence[int]) -> None:
        """Take a reference on each of `pages`, which other leases hold, and append them."""
        self._check_live("share")
        seen: set[int] = set()
        for p in pages:
            if p in self._held or p in seen:
                why = "it holds it already" if p in self._held else "it is listed twice"
                raise LeaseError(f"lease of {self.owner!r} cannot share page {p}: {why}")
            seen.add(p)
        allocator = self._registry.allocator
        if self.part is not None and allocator.parts > 1:
            other = next((p for p in pages if allocator.part_of(p) != self.part), None)
            if other is not None:
                raise LeaseError(
                    f"lease of {self.owner!r} in part {self.part} cannot share page {other} "
                    f"of part {allocator.part_of(other)}"
                )
        allocator.retain(pages)  # refuses a free page, changing nothing
        self._append(pages)

    def _append(self, pages: Sequence[int]) -> None:
        if self._index is not None:
            self._index.update((p, i) for i, p in enumerate(pages, len(self._pages)))
        self._pages.extend(pages)
        self._held.update(pages)

    def drop(self, pages: Sequence[int]) -> None:
        """Drop the references on some of its pages, which leave it (the prefix cache evicting);
        LeaseError, nothing dropped, if it does not hold each exactly once. Each leaving page's
        place is taken by the last page: O(len(pages)), and the order is no longer the order
        of adding (a request's lease, whose order is its page table, never drops)."""
        self._check_live("drop")
        pages = list(pages)  # a copy: `pages` may be this lease's own list, which changes below
        gone = set(pages)
        if len(gone) != len(pages) or not gone <= self._held:
            raise LeaseError(f"lease of {self.owner!r} cannot drop {list(pages)}: not its pages")
        self._registry.allocator.release(pages)
        if self._index is None:  # the first drop: one pass, then kept up to date
            self._index = {p: i for i, p in enumerate(self._pages)}
        index, held = self._index, self._pages
        for p in pages:
            i = index.pop(p)
            last = held.pop()
            if i < len(held):  # p was not the last: the last page moves into its place
                held[i] = last
                index[last] = i
        self._held -= gone

    def release(self) -> None:
        """Drop every reference; the lease ends. A second call raises LeaseError."""
        self._check_live("release")
        self._registry.allocator.release(self._pages)
        if self.slot is not None and self._registry.slots is not None:
            self._registry.slots.give_back(self.slot)
        self._end(LeaseState.RELEASED)

    def hand_over(self, owner: Hashable) -> Lease:
        """End this lease and give its references, counts unchanged, to a new one for `owner`."""
        self._check_live("hand over")
        heir = Lease(self._registry, owner, self._pages, self.slot, self.part)
        self._registry._add(heir)
        self.heir = owner
        self._end(LeaseState.HANDED_OVER)
        return heir

    def _end(self, state: LeaseState) -> None:
        self._pages = []
        self.slot = None
        self._held = set()
        self._index = None
        self.state = state
        self._registry._remove(self)

    def _check_live(self, verb: str) -> None:
        if self.state is LeaseState.LIVE:
            return
        ended = self.state.value
        if self.heir is not None:
            ended += f" to {self.heir!r}"
        raise LeaseError(f"lease of {self.owner!r} cannot {verb}: it was already {ended}")


class Leases:
    """Every live lease on one pool's pages: the only way pages are taken and given back."""

    def __init__(self, allocator: PageAllocator, slots: StatePool | None = None) -> None:
        self.allocator = allocator
        self.slots = slots  # the per-request state slots, where the pool keeps any
        self._live: dict[Lease, None] = {}  # insertion-ordered set

    def __len__(self) -> int:
        return len(self._live)

    def live(self) -> list[Lease]:
        return list(self._live)

    def open(self, owner: Hashable, n: int = 0, part: int | None = 0) -> Lease:
        """A lease for `owner` holding `n` fresh pages of `part`; PageAllocError, nothing held,
        if fewer are free. `part` None: a lease that only shares, pages of any part."""
        if part is None and n:
            raise LeaseError(f"lease of {owner!r}: fresh pages are taken in a part")
        lease = Lease(self, owner, self.allocator.allocate(n, part or 0), part=part)
        self._add(lease)
        return lease

    def _add(self, lease: Lease) -> None:
        """Register a lease whose references are already counted (Lease.hand_over)."""
        self._live[lease] = None

    def _remove(self, lease: Lease) -> None:
        """Forget a lease that ended (Lease._end)."""
        del self._live[lease]

    def violations(self) -> list[str]:
        """Pages whose reference count is not the number of live leases holding them, and the
        allocator's own inconsistencies. Empty when all is well. O(num_pages + pages held)."""
        holders: dict[int, list[Hashable]] = {}
        for lease in self._live:
            for p in lease.pages:
                holders.setdefault(p, []).append(lease.owner)
        out = self.allocator.violations()
        for p in range(self.allocator.num_pages):
            refs, owners = self.allocator.refcount(p), holders.get(p, [])
            if refs != len(owners):
                out.append(f"page {p}: refcount {refs}, held by {len(owners)} leases {owners}")
        if self.slots is not None:
            out += self.slots.violations([s.slot for s in self._live if s.slot is not None])
        if len(out) > VIOLATIONS_LISTED:
            out[VIOLATIONS_LISTED:] = [f"... and {len(out) - VIOLATIONS_LISTED} more"]
        return out
