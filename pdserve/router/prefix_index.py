"""PrefixIndex: the router's guess of which prompt prefixes one worker holds in its cache.

The worker's prefix cache (kvcache/prefix_cache.py) keys a full page by a chain over its whole
prefix: (the previous page's key, this page's token ids). The router keys the prompts it sends
with the very same function (`page_keys`, protocol/page_keys.py, the one definition both
import) and remembers, per worker, the keys of the pages it sent there. A prompt's expected
hit on a worker is then the longest run of its page keys, from the first, that the worker's
index holds (`match`).

It is approximate by design, and only ever a routing hint: the router does not see the worker
evict, nor which requests failed, and it keeps keys, not tokens (a 64-bit hash collision costs
a worse route, never wrong KV: the worker checks tokens itself). Memory is bounded: at most
`capacity` keys per worker, least recently sent first out. A prompt's keys are refreshed first
page last, so a chain is dropped from its tail and never loses its head while its tail stays.
Sans-I/O and torch-free, like the rest of the router's decisions.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pdserve.config import CacheConfig

DEFAULT_CAPACITY_PAGES = 65536  # per worker: ~1M tokens at 16 a page, a few MB of router memory
DEFAULT_PAGE_SIZE = CacheConfig.page_size  # for workers whose /info does not say


def fleet_page_size(infos: Iterable[Mapping[str, Any]]) -> int:
    """The page size of the workers that hold the cache, from their /info ("layout"); the
    smallest if they differ (the index is a hint, so a finer grain only costs memory); the
    engine's default for workers that do not say."""
    sizes = set()
    for info in infos:
        layout = info.get("layout")
        size = layout.get("page_size") if isinstance(layout, Mapping) else None
        if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
            sizes.add(size)
    return min(sizes) if sizes else DEFAULT_PAGE_SIZE


class PrefixIndex:
    """One worker's page keys, least recently sent first, at most `capacity` of them."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY_PAGES) -> None:
        if capacity < 1:
            raise ValueError(f"a prefix index needs a capacity >= 1 page, got {capacity}")
        self.capacity = capacity
        self.evicted = 0  # keys dropped to stay within capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, keys: Sequence[int]) -> int:
        """How many of `keys` (a prompt's `page_keys`), from the first, this worker holds.
        A pure lookup: only `insert` (the request really went here) refreshes recency."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[int]) -> None:
        """Remember that a prompt with these page keys was sent here; evict past capacity."""
        for key in reversed(keys):  # the first page ends most recent: chains lose tails first
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
            self.evicted += 1
