import random

import pytest

from pdserve.kvcache.allocator import PageAllocator, PageAllocError


def test_allocate_release_roundtrip():
    a = PageAllocator(8)
    p = a.allocate(3)
    assert p == [0, 1, 2] and [a.refcount(x) for x in p] == [1, 1, 1]
    assert a.num_free == 5 and a.num_used == 3
    a.release(p)
    assert a.num_free == 8 and a.num_used == 0 and [a.refcount(x) for x in p] == [0, 0, 0]
    assert a.allocate(8) == list(range(8))  # released pages are handed out again lowest first


def test_a_shared_page_is_free_only_after_its_last_reference():
    a = PageAllocator(4)
    p = a.allocate(2)
    a.retain(p)
    a.retain([p[0]])
    assert [a.refcount(x) for x in p] == [3, 2] and a.num_used == 2 and a.num_free == 2
    a.release(p)
    assert [a.refcount(x) for x in p] == [2, 1] and a.num_free == 2
    a.release([p[0], p[1], p[0]])  # a page listed twice loses two references
    assert [a.refcount(x) for x in p] == [0, 0] and a.num_free == 4 and a.violations() == []


def test_release_of_a_free_page_names_it_and_changes_nothing():
    a = PageAllocator(4)
    p = a.allocate(2)
    with pytest.raises(PageAllocError, match=r"^page 3 released but it is free$"):
        a.release([p[0], 3])
    assert a.refcount(p[0]) == 1 and a.num_free == 2
    a.release(p)
    with pytest.raises(PageAllocError, match=r"^page 0 released but it is free$"):
        a.release(p)  # a double release
    assert a.num_free == 4 and a.violations() == []


def test_release_beyond_the_references_names_the_counts_and_changes_nothing():
    a = PageAllocator(4)
    p = a.allocate(2)
    with pytest.raises(PageAllocError, match=r"^page 1 released 2 times but it has 1 references$"):
        a.release([0, 1, 1])
    assert [a.refcount(x) for x in p] == [1, 1] and a.num_free == 2


def test_retain_of_a_free_page_names_it_and_changes_nothing():
    a = PageAllocator(4)
    p = a.allocate(1)
    with pytest.raises(PageAllocError, match=r"^page 2 retained but it is free$"):
        a.retain([p[0], 2])
    assert a.refcount(p[0]) == 1 and a.refcount(2) == 0 and a.num_free == 3


@pytest.mark.parametrize("page", [-1, 4])
def test_pages_outside_the_pool_are_refused(page):
    a = PageAllocator(4)
    a.allocate(4)
    for verb, call in (("retained", a.retain), ("released", a.release)):
        with pytest.raises(PageAllocError, match=rf"^page {page} {verb} but the pool has pages"):
            call([page])
    assert a.num_used == 4 and a.violations() == []


def test_over_allocation_refused():
    a = PageAllocator(2)
    assert a.can_allocate(2) and not a.can_allocate(3)
    with pytest.raises(PageAllocError, match=r"^asked for 3 pages, 2 free$"):
        a.allocate(3)
    with pytest.raises(PageAllocError, match=r"^asked for -1 pages$"):
        a.allocate(-1)
    assert a.num_free == 2 and a.allocate(0) == []


def test_violations_name_a_corrupted_page():
    a = PageAllocator(3)
    a.allocate(1)
    a._refs[0] = 0  # a bug that dropped a count without freeing the page
    a._free[0].append(2)  # and one that listed a free page twice
    assert a.violations() == [
        "page 0: refcount 0, in the free list 0 times",
        "page 2: refcount 0, in the free list 2 times",
    ]


def test_random_sequences_keep_counts_and_never_leak():
    rng = random.Random(7)
    a = PageAllocator(64)
    refs = [0] * 64  # the model: references per page
    for _ in range(3000):
        held = [p for p in range(64) if refs[p]]
        op = rng.random()
        if op < 0.4:
            n = rng.randint(0, 6)
            if a.can_allocate(n):
                for p in a.allocate(n):
                    assert refs[p] == 0
                    refs[p] = 1
        elif op < 0.6 and held:
            pages = rng.sample(held, rng.randint(1, min(3, len(held))))
            a.retain(pages)
            for p in pages:
                refs[p] += 1
        elif held:
            pages = rng.sample(held, rng.randint(1, min(4, len(held))))
            a.release(pages)
            for p in pages:
                refs[p] -= 1
        assert [a.refcount(p) for p in range(64)] == refs
        assert a.num_used == sum(1 for r in refs if r) and a.num_free + a.num_used == 64
    for p in range(64):
        a.release([p] * refs[p])
    assert a.num_free == 64 and a.violations() == []


def test_allocation_takes_the_lowest_free_pages_in_order():
    """Consecutive pages move as one NIXL descriptor, so freed pages are reused bottom up."""
    a = PageAllocator(10)
    p = a.allocate(6)
    a.release([p[4], p[1], p[2]])  # free 1, 2, 4 (out of order)
    assert a.allocate(2) == [1, 2] and a.allocate(3) == [4, 6, 7]
    a.release([0, 3, 5])
    assert a.allocate(5) == [0, 3, 5, 8, 9] and a.num_free == 0 and a.violations() == []


def test_a_quiet_pool_hands_out_one_run_after_churn():
    rng = random.Random(11)
    a = PageAllocator(100)
    live = []
    for _ in range(500):  # requests start and end in random order
        if live and (rng.random() < 0.5 or not a.can_allocate(10)):
            a.release(live.pop(rng.randrange(len(live))))
        else:
            live.append(a.allocate(rng.randint(1, 10)))
    for pages in live:
        a.release(pages)
    assert a.allocate(30) == list(range(30))  # the old FIFO list returned a shuffled mix


def test_parts_allocate_each_from_its_own_range():
    a = PageAllocator(8, parts=2)
    assert a.allocate(3, part=1) == [4, 5, 6]
    assert a.allocate(2) == [0, 1]  # part 0
    assert [a.part_of(p) for p in (0, 3, 4, 7)] == [0, 0, 1, 1]
    assert a.available(0) == 2 and a.available(1) == 1 and a.num_free == 3
    assert a.can_allocate(2, 0) and not a.can_allocate(2, 1)
    with pytest.raises(PageAllocError, match="2 pages, 1 free in part 1"):
        a.allocate(2, part=1)
    with pytest.raises(PageAllocError, match="part 2 of a pool in 2 part"):
        a.allocate(1, part=2)
    a.release([5, 0])
    assert a.allocate(1, part=1) == [5] and a.violations() == []


def test_parts_must_split_the_pool_evenly():
    with pytest.raises(ValueError, match="do not split into 3 equal parts"):
        PageAllocator(8, parts=3)


def test_a_part_short_of_pages_evicts_only_its_own():
    a = PageAllocator(4, parts=2)
    asked: list[tuple[int, int]] = []
    pages = a.allocate(2, part=1)  # [2, 3], cached, then only the cache holds them
    a.mark_cached(pages, True)
    assert a.available(1) == 2 and a.available(0) == 2 and a.num_evictable == 2

    def evict(n: int, part: int) -> None:
        asked.append((n, part))
        a.mark_cached(pages[:n], False)
        a.release(pages[:n])

    a.evict = evict
    assert a.allocate(2, part=0) == [0, 1] and asked == []  # part 0 had free pages
    assert a.allocate(1, part=1) == [2] and asked == [(1, 1)]
    assert a.violations() == []
