"""The prefix cache's host tier alone: byte-exact round trips of mixed-dtype pages, host LRU
and pins, and loads that complete, fail, time out or are abandoned while the copy runs."""

from __future__ import annotations

import pytest
import torch

from pdserve.kvcache.allocator import PageAllocator
from pdserve.kvcache.host_copier import ManualCopier, runs
from pdserve.kvcache.host_loads import Outcome
from pdserve.kvcache.host_pool import HostPool
from pdserve.kvcache.layout import BufferSpec, KVLayout
from pdserve.kvcache.lease import Lease, Leases
from pdserve.kvcache.pool import KVPool
from pdserve.kvcache.prefix_cache import PrefixCache
from pdserve.runtime import timing

PS = 4

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def mixed_layout() -> KVLayout:
    """The incident's shape: a bf16 buffer beside an fp8 one with its float32 scale, the
    fp8 pair in some layers only, each region of a different width."""
    return KVLayout(
        (
            BufferSpec("k", (2, 8), "bfloat16"),
            BufferSpec("index_k", (1, 24), "float8_e4m3fn", (0, 2)),
            BufferSpec("index_k_scale", (1,), "float32", (0, 2)),
        ),
        page_size=PS,
        num_layers=3,
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def setup(
    device: str = "cpu",
    pages: int = 8,
    host_pages: int = 8,
    layout: KVLayout | None = None,
    copier: ManualCopier | None = None,
) -> tuple[KVPool, Leases, PrefixCache, Clock]:
    pool = KVPool(layout or mixed_layout(), pages, torch.device(device))
    leases = Leases(pool.allocator)
    cache = PrefixCache(leases, PS, HostPool(pool, host_pages, copier))
    clock = Clock()
    assert cache.loads is not None
    cache.loads.clock = clock
    return pool, leases, cache, clock


def cached(leases: Leases, cache: PrefixCache, tokens: list[int]) -> list[int]:
    """Compute (as far as the cache knows) and cache `tokens`' full pages; returns them."""
    lease = leases.open(f"r{tokens[0]}", len(tokens) // PS)
    pages = list(lease.pages)
    cache.insert(tokens, pages, len(tokens))
    lease.release()
    return pages


def raw(t: torch.Tensor) -> torch.Tensor:
    """A typed tensor's bytes (NaN bit patterns compare equal as bytes, not as floats)."""
    return t.contiguous().cpu().view(torch.uint8)


def ok(leases: Leases, cache: PrefixCache) -> None:
    assert leases.violations() == [] and cache.violations() == []


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtype_pages_round_trip_device_host_device_byte_exact(device):
    """The test the incident would have failed: every buffer of every layer, fp8 and bf16 NaN
    patterns included, comes back bit for bit, in every typed view."""
    pool, leases, cache, _ = setup(device, pages=6, host_pages=6)
    g = torch.Generator().manual_seed(1)  # every bit pattern, fp8 and bf16 NaNs included
    pool.data.copy_(torch.randint(0, 256, tuple(pool.data.shape), dtype=torch.uint8, generator=g))
    tokens = list(range(1, 13))  # 3 pages
    pages = cached(leases, cache, tokens)
    before = pool.data[pages].cpu().clone()
    views = {
        (r.layer, r.spec.name): raw(pool.view(r.layer, r.spec.name)[pages]).clone()
        for r in pool.layout.regions
    }
    assert cache.clear() == 3 and cache.stats.host_written_pages == 3
    assert cache.host is not None and len(cache.host) == 3
    if device == "cuda":
        torch.cuda.synchronize()
    pool.data.fill_(0xA5)  # the device copies are gone
    assert cache.match(tokens) == []
    hit = cache.match_host(tokens, 0, 8)
    assert len(hit.pages) == 3
    assert cache.loads is not None
    load = cache.loads.start("r", hit.keys, hit.pages)
    assert load is not None
    if device == "cuda":
        torch.cuda.synchronize()
    ((done, outcome),) = cache.loads.poll()
    assert done is load and outcome is Outcome.LOADED
    back = list(load.lease.pages)
    assert torch.equal(pool.data[back].cpu(), before)
    for r in pool.layout.regions:
        got = raw(pool.view(r.layer, r.spec.name)[back])
        assert torch.equal(got, views[(r.layer, r.spec.name)]), (r.layer, r.spec.name)
    cache.loads.end(load)
    ok(leases, cache)
    assert cache.host.pins == {} and leases.allocator.num_used == 0


def test_the_host_pool_has_the_device_pools_descriptor_and_page_size():
    pool, _, cache, _ = setup()
    assert cache.host is not None and cache.host.layout is pool.layout
    assert tuple(cache.host.data.shape) == (8, pool.layout.page_bytes)
    assert (
        pool.layout.page_bytes % 64 == 0 and len({r.spec.dtype for r in pool.layout.regions}) == 3
    )


def test_runs_coalesce_consecutive_pages():
    assert runs([(0, 5), (1, 6), (2, 7), (4, 8), (5, 9), (9, 1)]) == [
        (0, 5, 3),
        (4, 8, 2),
        (9, 1, 1),
    ]


def test_host_lru_evicts_tails_first_and_never_a_pinned_page():
    _, leases, cache, _ = setup(pages=8, host_pages=3)
    assert cache.host is not None
    a = list(range(1, 13))  # 3 pages
    b = list(range(101, 109))  # 2 pages
    cached(leases, cache, a)
    cache.clear()  # a's 3 pages fill the host pool
    pinned = cache.match_host(a, 0, 1)  # a load reads a's first page
    assert len(pinned.pages) == 1 and cache.host.pins == {pinned.pages[0]: 1}
    assert cache.host.violations() == [] and leases.violations() == []
    cached(leases, cache, b)
    cache.clear()  # b needs 2 host pages: a's tail goes, not its pinned head
    assert cache.stats.host_evicted_pages == 2 and cache.stats.host_written_pages == 5
    assert len(cache.match_host(b, 0, 8).pages) == 2
    assert cache.match_host(a, 0, 8).pages == pinned.pages  # a's head only
    assert cache.match_host(a, 1, 8).pages == []  # a continuation needs its own page
    assert cache.host.violations() == []
    assert cache.violations() != []  # pins no load accounts for: the loads' check sees them
    cache.host.unpin(list(cache.host.pins.elements()))
    ok(leases, cache)
    assert cache.host.allocator.num_used == 3 and cache.host.pins == {}


def test_a_load_keeps_its_pages_until_its_copy_ended_whatever_happens_to_it():
    copier = ManualCopier()
    pool, leases, cache, clock = setup(copier=copier)
    loads = cache.loads
    assert loads is not None and cache.host is not None
    tokens = list(range(1, 9))
    cached(leases, cache, tokens)
    cache.clear()
    hit = cache.match_host(tokens, 0, 8)
    load = loads.start("r", hit.keys, hit.pages)
    assert load is not None and loads.poll() == [] and loads.has_work()
    ok(leases, cache)
    # Abandoned while the copy runs: nothing goes back yet.
    loads.abandon("r")
    assert loads.poll() == [] and load.lease.live and leases.allocator.num_used == 2
    assert cache.host.pins == {p: 1 for p in hit.pages}
    ok(leases, cache)
    copier.complete()
    assert loads.poll() == [] and not load.lease.live and leases.allocator.num_used == 0
    assert cache.host.pins == {}
    ok(leases, cache)
    # Timed out: the request is told at once, the pages wait for the copy.
    hit = cache.match_host(tokens, 0, 8)
    load = loads.start("s", hit.keys, hit.pages)
    assert load is not None
    clock.now += timing.HOST_LOAD_TIMEOUT_S + 0.1
    assert loads.poll() == [(load, Outcome.TIMED_OUT)] and load.lease.live
    assert not loads.has_work()  # past its deadline: it does not keep the loop spinning
    copier.complete()
    loads.poll()
    assert not load.lease.live and cache.host.pins == {}
    ok(leases, cache)
    # Failed: the host entries are forgotten, the request recomputes.
    hit = cache.match_host(tokens, 0, 8)
    load = loads.start("t", hit.keys, hit.pages)
    assert load is not None
    copier.complete(load.copy, fail=True)
    assert loads.poll() == [(load, Outcome.FAILED)]
    assert not load.lease.live and len(cache.host) == 0
    ok(leases, cache)
    assert leases.allocator.num_used == 0 and cache.host.allocator.num_used == 0


def test_a_load_that_does_not_fit_the_device_unpins_its_host_pages():
    pool, leases, cache, _ = setup(pages=4, host_pages=8)
    assert cache.loads is not None and cache.host is not None
    tokens = list(range(1, 13))
    cached(leases, cache, tokens)
    cache.clear()
    hog = leases.open("hog", 3)
    hit = cache.match_host(tokens, 0, 8)
    assert len(hit.pages) == 3 and cache.loads.start("r", hit.keys, hit.pages) is None
    assert cache.host.pins == {}
    hog.release()
    ok(leases, cache)


def test_an_evicted_page_already_on_the_host_is_not_copied_again():
    copier = ManualCopier()
    _, leases, cache, _ = setup(copier=copier)
    assert cache.loads is not None
    tokens = list(range(1, 9))
    cached(leases, cache, tokens)
    cache.clear()
    hit = cache.match_host(tokens, 0, 8)
    load = cache.loads.start("r", hit.keys, hit.pages)
    assert load is not None
    copier.complete()
    cache.loads.poll()
    user: Lease = leases.open("r")
    user.share(load.lease.pages)
    cache.loads.end(load)
    cache.insert(tokens, list(user.pages), 8)
    user.release()
    cache.clear()
    assert cache.stats.host_written_pages == 2  # the first eviction only
    ok(leases, cache)


def test_violations_name_a_host_page_indexed_but_free():
    _, leases, cache, _ = setup()
    assert cache.host is not None
    cached(leases, cache, list(range(1, 5)))
    cache.clear()
    (entry,) = cache.host._entries.values()
    cache.host.allocator.release([entry.page])  # corrupt: indexed, yet free
    assert any("free but indexed" in v for v in cache.host.violations())
    assert PageAllocator(1).violations() == []
