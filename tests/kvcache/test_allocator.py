import random

import pytest

from pdserve.kvcache.allocator import PageAllocator, PageAllocError


def test_allocate_free_roundtrip():
    a = PageAllocator(8)
    p = a.allocate(3, "r1")
    assert len(set(p)) == 3 and a.num_free == 5 and a.num_used == 3
    a.free(p, "r1")
    assert a.num_free == 8 and a.num_used == 0


def test_double_free_and_foreign_free_refused():
    a = PageAllocator(4)
    p = a.allocate(2, "r1")
    with pytest.raises(PageAllocError, match="held by 'r1'"):
        a.free(p, "r2")
    a.free(p, "r1")
    with pytest.raises(PageAllocError, match="not allocated"):
        a.free(p, "r1")
    assert a.num_free == 4


def test_over_allocation_refused():
    a = PageAllocator(2)
    assert not a.can_allocate(3)
    with pytest.raises(PageAllocError):
        a.allocate(3, "r")
    assert a.num_free == 2


def test_random_sequences_never_leak_or_share():
    rng = random.Random(7)
    a = PageAllocator(64)
    held: dict[str, list[int]] = {}
    for step in range(2000):
        if held and rng.random() < 0.45:
            owner = rng.choice(sorted(held))
            a.free(held.pop(owner), owner)
        else:
            n = rng.randint(1, 6)
            if a.can_allocate(n):
                held[f"r{step}"] = a.allocate(n, f"r{step}")
        all_pages = [p for ps in held.values() for p in ps]
        assert len(all_pages) == len(set(all_pages))
        assert a.num_used == len(all_pages) and a.num_free + a.num_used == 64
    for owner, pages in held.items():
        a.free(pages, owner)
    assert a.num_free == 64
