"""The router predicts a worker's prefix-cache hits with the worker's own page keys.

Cache-aware routing (router/prefix_index.py) is only right while the router keys a prompt's
pages exactly as the worker's cache (kvcache/prefix_cache.py) does; both take the key from
protocol/page_keys.py. These tests hold the two to that, on the same tokens.
"""

from __future__ import annotations

import random

from pdserve.kvcache.allocator import PageAllocator
from pdserve.kvcache.lease import Leases
from pdserve.kvcache.prefix_cache import PrefixCache
from pdserve.protocol.page_keys import ROOT, page_keys
from pdserve.router.prefix_index import PrefixIndex

PS = 4


def worker_cache(num_pages: int = 64) -> tuple[Leases, PrefixCache]:
    leases = Leases(PageAllocator(num_pages))
    return leases, PrefixCache(leases, PS)


def cache_prompt(leases: Leases, cache: PrefixCache, tokens: list[int], name: str) -> None:
    """A request computed `tokens` and finished: its full pages are cached."""
    lease = leases.open(name, -(-len(tokens) // PS))
    cache.insert(tokens, list(lease.pages), len(tokens))
    lease.release()


def test_the_routers_keys_are_the_worker_caches_keys_for_the_same_tokens() -> None:
    leases, cache = worker_cache()
    tokens = [5, 17, 17, 3, 900, 2**40, 0, 1, 8, 8, 8, 8, 42]  # 3 full pages and a partial one
    cache_prompt(leases, cache, tokens, "r")
    # The worker's keys in page order: follow the chain of its entries from the root.
    child = {entry.parent: key for (_part, key), entry in cache._entries.items()}
    worker_keys = [child[ROOT]]
    while worker_keys[-1] in child:
        worker_keys.append(child[worker_keys[-1]])
    assert len(worker_keys) == len(cache) == 3
    assert page_keys(tokens, PS) == worker_keys
    assert page_keys(tuple(tokens), PS) == worker_keys  # any sequence of the same ids


def test_the_routers_predicted_match_is_the_worker_caches_match() -> None:
    """Random prompts over a few shared prefixes: for every one, the pages the router expects
    a worker to have (its index of what it sent there) are the pages that worker's cache
    matches, as long as the cache evicted nothing."""
    rng = random.Random(3)
    heads = [[rng.randrange(50) for _ in range(rng.randrange(0, 13))] for _ in range(4)]
    leases, cache = worker_cache(num_pages=4096)
    index = PrefixIndex(capacity=4096)
    hits = 0
    for i in range(60):
        tokens = rng.choice(heads) + [rng.randrange(50) for _ in range(rng.randrange(0, 10))]
        expected = index.match(page_keys(tokens, PS))
        assert expected == len(cache.match(tokens)), (i, tokens)
        hits += expected > 0
        index.insert(page_keys(tokens, PS))  # the router sent it here
        cache_prompt(leases, cache, tokens, f"r{i}")
    assert hits > 10 and cache.stats.evicted_pages == 0 and len(index) == len(cache)
