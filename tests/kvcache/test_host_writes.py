"""Writes to the host tier are kept until they end (kvcache/host_pool.py): a page is served
only once its bytes arrived, a failed write's entries go, a page being written is never
evicted, and pinned host memory is released only after its last copy."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.kvcache.allocator import PageAllocator
from pdserve.kvcache.host_copier import Copy, CopyState, copy_pages
from pdserve.kvcache.host_pool import HostPool, unpin_after
from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.lease import Leases
from pdserve.kvcache.pool import KVPool
from pdserve.kvcache.prefix_cache import PrefixCache

PS = 4


@dataclass
class Pending:
    """A copy that ends only when the test says (as a CUDA event completes later)."""

    result: CopyState = CopyState.PENDING

    def state(self) -> CopyState:
        return self.result


@dataclass
class LateWrites:
    """A copier whose writes to the host end when told, DONE or FAILED; loads run at once."""

    writes: list[Pending] = field(default_factory=list)
    fail_at_once: bool = False  # a write that fails as it is issued

    def copy(
        self, src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]], to_host: bool
    ) -> Copy:
        copy_pages(src, dst, pairs)
        if not to_host:
            return Pending(CopyState.DONE)
        self.writes.append(Pending(CopyState.FAILED if self.fail_at_once else CopyState.PENDING))
        return self.writes[-1]


def setup(host_pages: int = 4) -> tuple[Leases, PrefixCache, HostPool, LateWrites]:
    layout = KVLayout.llama("float32", PS, num_layers=1, num_kv_heads=1, head_dim=4)
    pool = KVPool(layout, 8, torch.device("cpu"))
    leases = Leases(pool.allocator)
    copier = LateWrites()
    host = HostPool(pool, host_pages, copier)
    return leases, PrefixCache(leases, PS, host), host, copier


def evicted(leases: Leases, cache: PrefixCache, tokens: list[int]) -> None:
    """`tokens` computed, cached, then pushed out of the device cache to the host."""
    lease = leases.open(f"r{tokens[0]}", len(tokens) // PS)
    cache.insert(tokens, list(lease.pages), len(tokens))
    lease.release()
    cache.clear()


def clean(leases: Leases, cache: PrefixCache) -> None:
    assert leases.violations() == [] and cache.violations() == []


def test_a_page_is_served_from_the_host_only_once_its_write_ended() -> None:
    leases, cache, host, copier = setup()
    tokens = list(range(1, 9))  # 2 pages
    evicted(leases, cache, tokens)
    assert len(host) == 2 and host.writing and cache.stats.host_written_pages == 2
    clean(leases, cache)
    assert cache.match_host(tokens, 0, 8).pages == []  # its bytes may not be there yet
    assert host.pins == {}
    (write,) = copier.writes
    write.result = CopyState.DONE
    hit = cache.match_host(tokens, 0, 8)
    assert len(hit.pages) == 2 and not host.writing and host.writes == []
    host.unpin(hit.pages)
    clean(leases, cache)


def test_a_failed_write_drops_its_entries() -> None:
    leases, cache, host, copier = setup()
    tokens = list(range(1, 9))
    evicted(leases, cache, tokens)
    copier.writes[0].result = CopyState.FAILED
    assert cache.match_host(tokens, 0, 8).pages == []
    assert len(host) == 0 and host.allocator.num_used == 0 and host.write_failed_pages == 2
    assert host.snapshot()["write_failed_pages"] == 2
    clean(leases, cache)
    evicted(leases, cache, tokens)  # written again, this time it arrives
    copier.writes[1].result = CopyState.DONE
    assert len(cache.match_host(tokens, 0, 8).pages) == 2


def test_a_write_that_failed_at_once_is_not_counted_nor_kept() -> None:
    leases, cache, host, copier = setup()
    copier.fail_at_once = True
    evicted(leases, cache, list(range(1, 9)))
    assert cache.stats.host_written_pages == 0 and len(host) == 0 and host.writes == []
    assert host.write_failed_pages == 2 and host.allocator.num_used == 0
    clean(leases, cache)


def test_a_page_being_written_is_not_evicted_for_a_newer_one() -> None:
    leases, cache, host, copier = setup(host_pages=2)
    a, b = list(range(1, 9)), list(range(101, 105))
    evicted(leases, cache, a)  # fills the host pool; its write still runs
    evicted(leases, cache, b)  # no room: a's pages are still being written
    assert len(host) == 2 and cache.stats.host_written_pages == 2
    assert cache.stats.host_evicted_pages == 0
    clean(leases, cache)
    copier.writes[0].result = CopyState.DONE
    evicted(leases, cache, b)  # now a's tail may go
    assert cache.stats.host_evicted_pages == 1 and cache.stats.host_written_pages == 3
    copier.writes[1].result = CopyState.DONE
    hit = cache.match_host(b, 0, 8)
    assert len(hit.pages) == 1
    host.unpin(hit.pages)
    clean(leases, cache)


@dataclass
class Cudart:
    unregistered: list[int] = field(default_factory=list)

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802 - the CUDA runtime's name
        self.unregistered.append(ptr)
        return 0


@dataclass
class EndsAfter:
    """Pending for its first `polls` looks, then DONE."""

    polls: int

    def state(self) -> CopyState:
        self.polls -= 1
        return CopyState.PENDING if self.polls >= 0 else CopyState.DONE


def test_pinned_memory_is_unregistered_only_after_its_last_copy() -> None:
    data = torch.zeros(16, dtype=torch.uint8)
    cudart = Cudart()
    copy = EndsAfter(polls=3)
    assert unpin_after(cudart, data, [copy, Pending(CopyState.DONE)])
    assert copy.polls < 0 and cudart.unregistered == [data.data_ptr()]
    # A copy that never ends: the memory stays registered (and allocated) for good.
    stuck = Cudart()
    assert not unpin_after(stuck, data, [Pending()], timeout_s=0.0)
    assert stuck.unregistered == []


def test_the_accounting_names_a_page_whose_write_holds_no_reference() -> None:
    leases, cache, host, _ = setup()
    evicted(leases, cache, list(range(1, 5)))
    (page,) = host.writing
    host.allocator.release([page])  # corrupt: the write's reference gone
    assert any("its write" in v for v in host.violations())
    assert PageAllocator(1).violations() == []
