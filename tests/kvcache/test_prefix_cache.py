"""The prefix cache alone: chain keys, match, insert, LRU eviction, and the lease invariant."""

from __future__ import annotations

import random

import pytest

from pdserve.kvcache.allocator import PageAllocator, PageAllocError
from pdserve.kvcache.lease import Lease, Leases
from pdserve.kvcache.prefix_cache import OWNER, PrefixCache
from pdserve.protocol import page_keys

PS = 4  # tokens per page


def setup(num_pages: int) -> tuple[Leases, PrefixCache]:
    leases = Leases(PageAllocator(num_pages))
    return leases, PrefixCache(leases, PS)


def computed(leases: Leases, owner: str, tokens: list[int]) -> Lease:
    """A request's lease with pages for `tokens` (their KV as if computed)."""
    return leases.open(owner, -(-len(tokens) // PS))


def ok(leases: Leases, cache: PrefixCache) -> None:
    assert leases.violations() == [] and cache.violations() == []


def test_only_full_computed_pages_are_cached_and_matched_from_the_start():
    leases, cache = setup(8)
    tokens = list(range(1, 11))  # 2 full pages and 2 tokens
    lease = computed(leases, "a", tokens)
    assert cache.insert(tokens, lease.pages, num_computed=10) == 2
    assert cache.insert(tokens, lease.pages, num_computed=10) == 0  # already there
    assert cache.lease.owner == OWNER and list(cache.lease.pages) == list(lease.pages[:2])
    ok(leases, cache)
    assert cache.match(tokens) == list(lease.pages[:2])
    assert cache.match(tokens[:7]) == list(lease.pages[:1])  # a partial page never matches
    assert cache.match([99] + tokens[1:]) == []  # the first page differs: no later page either
    assert cache.stats.queries == 0  # a lookup counts once it is used
    cache.record(9, 8)
    cache.record(9, 0)
    assert cache.stats.queries == 2 and cache.stats.hits == 1 and cache.stats.hit_tokens == 8
    assert cache.stats.query_tokens == 18
    lease.release()  # the request ends; the cache keeps its two pages
    assert leases.allocator.num_used == 2 and leases.allocator.num_evictable == 2
    ok(leases, cache)


def test_uncomputed_pages_are_not_cached():
    leases, cache = setup(8)
    tokens = list(range(1, 13))
    lease = computed(leases, "a", tokens)
    assert cache.insert(tokens, lease.pages, num_computed=7) == 1
    assert cache.match(tokens) == [lease.pages[0]]


def test_a_page_is_keyed_by_its_whole_prefix():
    leases, cache = setup(8)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [9, 9, 9, 9, 5, 6, 7, 8]  # the same second page after another first page
    la = computed(leases, "a", a)
    cache.insert(a, la.pages, 8)
    assert cache.match(b) == []
    lb = computed(leases, "b", b)
    assert cache.insert(b, lb.pages, 8) == 2
    assert cache.match(b) == list(lb.pages) and cache.match(a) == list(la.pages)


def test_a_hash_collision_is_a_miss_not_someone_elses_kv(monkeypatch):
    monkeypatch.setattr(page_keys, "page_key", lambda parent, tokens: 42)
    leases, cache = setup(8)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    la, lb = computed(leases, "a", a), computed(leases, "b", b)
    assert cache.insert(a, la.pages, 4) == 1
    assert cache.insert(b, lb.pages, 4) == 0  # its key is taken by other tokens
    assert cache.match(b) == [] and cache.match(a) == list(la.pages)
    ok(leases, cache)


def test_eviction_takes_least_recently_used_pages_only_the_cache_holds():
    leases, cache = setup(6)
    a, b = list(range(1, 9)), list(range(101, 109))
    la, lb = computed(leases, "a", a), computed(leases, "b", b)
    pa, pb = list(la.pages), list(lb.pages)
    cache.insert(a, pa, 8)
    cache.insert(b, pb, 8)
    la.release()
    lb.release()
    cache.match(a)  # a is now the most recent
    assert leases.allocator.num_free == 2 and leases.allocator.can_allocate(6)
    assert not leases.allocator.can_allocate(7)
    assert cache.evict(1) == 1
    assert cache.match(b) == pb[:1]  # b, least recent, lost its tail first
    assert cache.evict(2) == 2  # now a is the least recent
    assert cache.match(a) == [] and cache.match(b) == pb[:1]
    assert leases.allocator.num_free == 5
    ok(leases, cache)


def test_a_chain_is_evicted_from_its_tail_and_shared_pages_stay():
    leases, cache = setup(6)
    a = list(range(1, 13))  # 3 pages
    la = computed(leases, "a", a)
    cache.insert(a, la.pages, 12)
    first, second, third = la.pages
    la.release()
    user = leases.open("b")
    user.share([first])  # a request holds the first page
    assert leases.allocator.num_evictable == 2
    assert cache.evict(1) == 1 and cache.match(a) == [first, second]  # the tail went
    assert cache.clear() == 1  # the second; the first is held by b
    assert cache.match(a) == [first] and cache.stats.evicted_pages == 2
    ok(leases, cache)
    user.release()
    assert cache.clear() == 1 and leases.allocator.num_used == 0
    assert third not in cache.lease.pages
    ok(leases, cache)


def test_allocate_evicts_when_the_free_list_is_short_and_never_takes_held_pages():
    leases, cache = setup(4)
    a = list(range(1, 13))
    la = computed(leases, "a", a)
    cache.insert(a, la.pages, 12)
    keep = leases.open("b")
    keep.share([la.pages[0]])
    la.release()
    assert leases.allocator.num_free == 1 and leases.allocator.num_evictable == 2
    fresh = leases.open("c", 3)  # 1 free + 2 evicted
    assert set(fresh.pages).isdisjoint(keep.pages)
    assert cache.match(a) == list(keep.pages)
    with pytest.raises(PageAllocError):
        leases.open("d", 1)  # the cached page b holds is not evictable
    ok(leases, cache)


def test_random_requests_keep_every_refcount_equal_to_its_leases():
    rng = random.Random(7)
    leases, cache = setup(24)
    prefixes = [[rng.randrange(1, 50) for _ in range(12)] for _ in range(3)]
    live: list[tuple[list[int], Lease]] = []
    for i in range(400):
        if live and rng.random() < 0.45:
            tokens, lease = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.8:  # finished; else failed, nothing cached
                cache.insert(tokens, lease.pages, rng.randrange(len(tokens) + 1))
            lease.release()
        else:
            tokens = rng.choice(prefixes)[: rng.randrange(1, 13)] + [
                rng.randrange(1, 50) for _ in range(rng.randrange(0, 9))
            ]
            hit = cache.match(tokens[: len(tokens) - 1])
            need = -(-len(tokens) // PS) - len(hit)
            lease = leases.open(f"r{i}")
            lease.share(hit)
            if not leases.allocator.can_allocate(need):
                lease.release()
                continue
            lease.extend(need)
            cache.record(len(tokens) - 1, len(hit) * PS)
            live.append((tokens, lease))
        ok(leases, cache)
    assert cache.stats.hits > 0 and cache.stats.evicted_pages > 0


def test_a_lease_drops_only_pages_it_holds_each_once():
    leases = Leases(PageAllocator(4))
    a = leases.open("a", 3)
    p0, p1, p2 = a.pages
    with pytest.raises(PageAllocError):
        a.drop([p0, p0])
    with pytest.raises(PageAllocError):
        a.drop([3])  # free, not a's
    assert list(a.pages) == [p0, p1, p2] and leases.allocator.num_used == 3
    a.drop([p1])
    assert list(a.pages) == [p0, p2] and leases.allocator.refcount(p1) == 0
    assert leases.violations() == []
