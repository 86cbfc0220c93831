"""The prefix cache: KV pages of finished prompts, reused by later requests with the same prefix.

Like vLLM's automatic prefix caching (and SGLang's radix cache at page granularity), the key of
a page is a chain over its whole prefix: (the key of the page before it, this page's token ids),
computed by protocol/page_keys.py, the definition the router's cache-aware policy shares.
Only full pages whose KV was computed are cached, so a page is reused only after exactly the
same tokens. Each entry keeps its token ids and its parent's key and a lookup compares them, so
a hash collision is a miss, never someone else's KV.

The cache holds its pages through its own lease (owner OWNER), so `Leases.violations` still
sees every reference: a cached page's count is 1 (the cache's) plus the requests sharing it.
A page only the cache holds is evictable (the allocator counts those and calls `evict` when its
free list is short), least recently used first; a lookup or an insert makes its pages the most
recently used, the first page of a prefix last, so a chain is evicted from its tail.
Sans-I/O, engine-thread only, like the allocator under it.

In a pool split into parts (data-parallel attention: kvcache/allocator.py), a page is reused
only by a request in its part, the rank whose pool holds it: an entry is keyed by (part, key),
`match` looks in one part, and `evict` frees the part that needs pages.

With a host tier (kvcache/host_pool.py, --host-cache-mb), an evicted page is first copied to
the host pool under the same key, and `match_host` continues a device match there: the
scheduler loads those pages back (kvcache/host_loads.py) before the request prefills the rest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from pdserve.kvcache.host_loads import HostLoads
from pdserve.kvcache.host_pool import Evicted, HostPool
from pdserve.kvcache.lease import Leases
from pdserve.protocol.page_keys import ChainPage, chain

OWNER = "prefix cache"


@dataclass(frozen=True)
class Entry:
    page: int
    parent: int  # the key of the page before it (page_keys.ROOT for a first page)
    tokens: tuple[int, ...]


@dataclass
class CacheStats:
    queries: int = 0  # lookups
    query_tokens: int = 0  # tokens looked up (those a hit could have covered)
    hits: int = 0  # lookups that matched at least one page
    hit_tokens: int = 0  # tokens served from the cache
    inserted_pages: int = 0
    evicted_pages: int = 0
    # The host tier (zero without one).
    host_hits: int = 0  # lookups served at least one page from the host tier
    host_hit_tokens: int = 0  # tokens served from the host tier (also in hit_tokens)
    host_written_pages: int = 0  # evicted device pages written to the host
    host_evicted_pages: int = 0  # host pages evicted to make room for newer ones
    host_loaded_pages: int = 0  # host pages loaded back into the device pool
    host_load_failures: int = 0  # loads whose copy failed: the request recomputed
    host_load_timeouts: int = 0  # loads past HOST_LOAD_TIMEOUT_S: the request recomputed


class HostMatch(NamedTuple):
    """Host pages continuing a device match, pinned for the load that reads them."""

    keys: list[int]
    pages: list[int]


class PrefixCache:
    def __init__(self, leases: Leases, page_size: int, host: HostPool | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.host = host
        # Loads from the host tier in flight (the scheduler starts and finishes them).
        self.loads = HostLoads(host, leases) if host is not None else None
        self.allocator = leases.allocator
        self.lease = leases.open(OWNER, part=None)  # pages of every part
        self.stats = CacheStats()
        # By (part, key), least recent first.
        self._entries: OrderedDict[tuple[int, int], Entry] = OrderedDict()
        self._key_of: dict[int, tuple[int, int]] = {}  # page -> (part, key)
        if self.allocator.evict is not None:
            raise ValueError("the allocator already has a cache evicting its pages")
        self.allocator.evict = self.evict

    def __len__(self) -> int:
        """Cached pages (shared with requests or not)."""
        return len(self._entries)

    def _keys(self, token_ids: Sequence[int], num_pages: int) -> list[ChainPage]:
        """The key, parent and tokens of each of the first `num_pages` full pages."""
        return chain(token_ids, self.page_size, num_pages)

    def _lookup(self, want: ChainPage, part: int) -> Entry | None:
        got = self._entries.get((part, want.key))
        if got is None or got.parent != want.parent or got.tokens != want.tokens:
            return None  # absent, or a hash collision
        return got

    def match(self, token_ids: Sequence[int], part: int = 0, touch: bool = True) -> list[int]:
        """The cached pages in `part` of the longest run of full pages of `token_ids` from its
        start, in order (no reference is taken: share them into a lease before anything can
        evict), made the most recently used unless `touch` is False (a lookup whose hit may
        go unused). Counted in the stats by `record`, once the lookup is used."""
        pages: list[int] = []
        keys: list[tuple[int, int]] = []
        for want in self._keys(token_ids, len(token_ids) // self.page_size):
            got = self._lookup(want, part)
            if got is None:
                break
            pages.append(got.page)
            keys.append((part, want.key))
        if touch:
            self._touch(keys)
        return pages

    def match_host(self, token_ids: Sequence[int], start: int, most: int) -> HostMatch:
        """Host pages of full pages `start`, `start + 1`, ... of `token_ids` (at most `most`),
        continuing a device match of `start` pages; each is pinned (HostPool.pin) for the
        load that will read it; a page whose write to the host has not ended is not served.
        Empty without a host tier."""
        if self.host is None or most < 1:
            return HostMatch([], [])
        self.host.settle()  # writes that ended since: their pages can be served now
        num_pages = min(len(token_ids) // self.page_size, start + most)
        keys: list[int] = []
        pages: list[int] = []
        for want in self._keys(token_ids, num_pages)[start:]:
            got = self.host.lookup(want.key, want.parent, want.tokens)
            if got is None:
                break
            keys.append(want.key)
            pages.append(got.page)
        self.host.touch(keys)
        self.host.pin(pages)
        return HostMatch(keys, pages)

    def record(self, query_tokens: int, hit_tokens: int, host_tokens: int = 0) -> None:
        """A lookup of `query_tokens` tokens served `hit_tokens` of them (`host_tokens` of
        those from the host tier) to an admitted request (one that looks up again next step,
        still waiting for pages, is counted then)."""
        self.stats.queries += 1
        self.stats.query_tokens += query_tokens
        self.stats.hits += int(hit_tokens > 0)
        self.stats.hit_tokens += hit_tokens
        self.stats.host_hits += int(host_tokens > 0)
        self.stats.host_hit_tokens += host_tokens

    def insert(self, token_ids: Sequence[int], pages: Sequence[int], num_computed: int) -> int:
        """Cache the full pages among the first `num_computed` tokens of `token_ids`, whose KV
        is in `pages` (a request's page table, which its lease holds). A page already cached
        under its key stays (the new copy goes back with its request's lease). Returns how
        many pages were added."""
        full = min(num_computed, len(token_ids)) // self.page_size
        if full > len(pages):
            raise ValueError(f"{full} full pages computed but a page table of {len(pages)}")
        part = self.allocator.part_of(pages[0]) if full else 0  # a lease's pages share one
        added: list[int] = []
        keys: list[tuple[int, int]] = []
        for i, want in enumerate(self._keys(token_ids, full)):
            key = (part, want.key)
            got = self._entries.get(key)
            if got is None:
                page = pages[i]
                if page in self._key_of:
                    break  # cached under another prefix: cannot be (KV is per position)
                self._entries[key] = Entry(page, want.parent, want.tokens)
                self._key_of[page] = key
                added.append(page)
            elif got.parent != want.parent or got.tokens != want.tokens:
                break  # a collision: its key is taken, so is every later page's chain
            keys.append(key)
        if added:
            self.lease.share(added)
            self.allocator.mark_cached(added, True)
        self._touch(keys)
        self.stats.inserted_pages += len(added)
        return len(added)

    def _touch(self, keys: list[tuple[int, int]]) -> None:
        """Most recently used: the prefix's first page last, so eviction takes tails first."""
        for key in reversed(keys):
            self._entries.move_to_end(key)

    def evict(self, n: int, part: int | None = None) -> int:
        """Free at least `n` pages only the cache holds (in `part`; None: any), least recently
        used first (fewer if fewer are evictable). Returns how many were freed."""
        gone: list[tuple[int, int]] = []
        for key, entry in self._entries.items():
            if len(gone) >= n:
                break
            if (part is None or key[0] == part) and self.allocator.refcount(entry.page) == 1:
                gone.append(key)
        pages = [self._entries[k].page for k in gone]
        if self.host is not None and gone:  # copied out before the pages can be reused
            leaving = [self._entries[k] for k in gone]
            stored = self.host.store(
                [
                    Evicted(k[1], e.page, e.parent, e.tokens)
                    for k, e in zip(gone, leaving, strict=True)
                ]
            )
            self.stats.host_written_pages += stored.written
            self.stats.host_evicted_pages += stored.dropped
        for key, page in zip(gone, pages, strict=True):
            del self._entries[key]
            del self._key_of[page]
        if pages:
            self.allocator.mark_cached(pages, False)
            self.lease.drop(pages)
        self.stats.evicted_pages += len(pages)
        return len(pages)

    def clear(self) -> int:
        """Evict every page no request holds (tests, and a future flush endpoint)."""
        return self.evict(len(self._entries))

    def violations(self) -> list[str]:
        """The cache agrees with its lease: the same pages, each under one key."""
        out = []
        mine = {e.page for e in self._entries.values()}
        if mine != set(self.lease.pages) or len(mine) != len(self._entries):
            out.append(
                f"prefix cache: {len(self._entries)} entries on {len(mine)} pages, "
                f"its lease holds {len(self.lease)}"
            )
        if self.host is not None and self.loads is not None:
            out += self.host.violations() + self.loads.violations()
        return out

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        return {
            "pages": len(self._entries),
            "pages_evictable": self.allocator.num_evictable,
            "queries": s.queries,
            "query_tokens": s.query_tokens,
            "hits": s.hits,
            "hit_tokens": s.hit_tokens,
            "inserted_pages": s.inserted_pages,
            "evicted_pages": s.evicted_pages,
            "host": None
            if self.host is None or self.loads is None
            else {
                **self.host.snapshot(),
                **self.loads.snapshot(),
                "hits": s.host_hits,
                "hit_tokens": s.host_hit_tokens,
                "written_pages": s.host_written_pages,
                "evicted_pages": s.host_evicted_pages,
                "loaded_pages": s.host_loaded_pages,
                "load_failures": s.host_load_failures,
                "load_timeouts": s.host_load_timeouts,
            },
        }
