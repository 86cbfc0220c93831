"""The chain key of a full KV page: the one definition the worker's cache and the router share.

A prompt's full pages are keyed as a chain over the whole prefix: a page's key is the hash of
(the key of the page before it, this page's token ids), and the first page's parent is ROOT.
So two pages share a key only after exactly the same tokens (or by a hash collision, which the
worker's cache catches by comparing tokens, and which costs the router only a worse route).

The worker's prefix cache (kvcache/prefix_cache.py) and its host tier index pages by these
keys; the router's cache-aware policy (router/prefix_index.py) predicts a worker's hits by
computing them for the prompts it sends. That prediction is only right if both sides compute
the same key from the same tokens, in different processes: hence one definition, here, in the
layer both may import (torch-free, like all of protocol/). `hash` of a tuple of ints is the
same in every process of one Python build: ints are never salted (PYTHONHASHSEED salts str
and bytes only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

ROOT = 0  # the parent key of a prompt's first page


def page_key(parent: int, tokens: tuple[int, ...]) -> int:
    """A full page's key: its tokens after the page whose key is `parent` (collisions are
    the cache's to catch, so a fast hash will do)."""
    return hash((parent, tokens))


class ChainPage(NamedTuple):
    """One full page of a prompt: its key, its parent's key and its token ids."""

    key: int
    parent: int
    tokens: tuple[int, ...]


def chain(
    token_ids: Sequence[int], page_size: int, num_pages: int | None = None
) -> list[ChainPage]:
    """The first `num_pages` (None: all) full pages of `token_ids`, keyed; a partial last page
    has no key."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    full = len(token_ids) // page_size
    n = full if num_pages is None else min(num_pages, full)
    out: list[ChainPage] = []
    parent = ROOT
    for i in range(n):
        tokens = tuple(token_ids[i * page_size : (i + 1) * page_size])
        key = page_key(parent, tokens)
        out.append(ChainPage(key, parent, tokens))
        parent = key
    return out


def page_keys(token_ids: Sequence[int], page_size: int) -> list[int]:
    """The chain key of each full page of `token_ids`."""
    return [p.key for p in chain(token_ids, page_size)]
