import random

import pytest

from pdserve.kvcache.allocator import PageAllocator, PageAllocError
from pdserve.kvcache.lease import Lease, LeaseError, Leases, LeaseState


def pool(n: int = 8) -> Leases:
    return Leases(PageAllocator(n))


def refs(leases: Leases) -> list[int]:
    return [leases.allocator.refcount(p) for p in range(leases.allocator.num_pages)]


def test_open_extend_release():
    ls = pool()
    a = ls.open("a", 2)
    assert list(a.pages) == [0, 1] and len(a) == 2 and a.live and ls.live() == [a]
    assert a.extend(3) == [2, 3, 4] and list(a.pages) == [0, 1, 2, 3, 4]
    assert a.extend(0) == [] and len(a) == 5
    assert refs(ls) == [1, 1, 1, 1, 1, 0, 0, 0] and ls.violations() == []
    a.release()
    assert a.state is LeaseState.RELEASED and list(a.pages) == [] and len(ls) == 0
    assert ls.allocator.num_free == 8 and ls.violations() == []


def test_an_empty_lease_opens_and_releases():
    ls = pool()
    a = ls.open("a")
    assert len(a) == 0 and len(ls) == 1
    a.release()
    assert len(ls) == 0 and ls.allocator.num_free == 8


def test_open_and_extend_beyond_the_free_pages_take_nothing():
    ls = pool(4)
    a = ls.open("a", 3)
    with pytest.raises(PageAllocError, match=r"^asked for 2 pages, 1 free$"):
        a.extend(2)
    with pytest.raises(PageAllocError, match=r"^asked for 2 pages, 1 free$"):
        ls.open("b", 2)
    assert list(a.pages) == [0, 1, 2] and ls.live() == [a] and ls.allocator.num_free == 1


def test_share_takes_a_reference_and_the_page_lives_until_the_last_release():
    ls = pool()
    a = ls.open("a", 3)
    b = ls.open("b", 1)
    b.share(a.pages[:2])  # a cached prefix: b's table is [3, 0, 1]
    assert list(b.pages) == [3, 0, 1] and refs(ls)[:4] == [2, 2, 1, 1]
    assert ls.violations() == []
    a.release()
    assert refs(ls)[:4] == [1, 1, 0, 1] and ls.allocator.num_free == 5
    assert ls.violations() == []
    b.release()
    assert ls.allocator.num_free == 8 and ls.violations() == [] and len(ls) == 0


def test_share_of_a_free_page_is_refused_and_changes_nothing():
    ls = pool()
    a = ls.open("a", 1)
    b = ls.open("b", 1)
    with pytest.raises(PageAllocError, match=r"^page 5 retained but it is free$"):
        b.share([0, 5])
    assert list(b.pages) == [1] and refs(ls)[:2] == [1, 1] and ls.violations() == []
    a.release()
    with pytest.raises(PageAllocError, match=r"^page 0 retained but it is free$"):
        b.share([0])  # a page its last holder released
    assert list(b.pages) == [1] and ls.violations() == []


def test_share_of_a_page_held_already_or_listed_twice_is_refused():
    ls = pool()
    a = ls.open("a", 2)
    b = ls.open("b", 1)
    msg = r"^lease of 'b' cannot share page 2: it holds it already$"
    with pytest.raises(LeaseError, match=msg):
        b.share([0, 2])
    with pytest.raises(LeaseError, match=r"^lease of 'b' cannot share page 0: it is listed twice$"):
        b.share([0, 0])
    assert list(b.pages) == [2] and refs(ls)[:3] == [1, 1, 1] and a.live


def test_a_second_release_is_an_error_and_changes_nothing():
    ls = pool()
    a = ls.open("a", 2)
    b = ls.open("b", 1)
    b.share([0])
    a.release()
    with pytest.raises(LeaseError, match=r"^lease of 'a' cannot release: it was already released$"):
        a.release()
    assert refs(ls)[:3] == [1, 0, 1] and ls.live() == [b] and ls.violations() == []


def test_an_ended_lease_refuses_every_verb():
    ls = pool()
    a = ls.open("a", 1)
    a.release()
    for verb, call in (
        ("extend", lambda: a.extend(1)),
        ("share", lambda: a.share([])),
        ("hand over", lambda: a.hand_over("x")),
    ):
        with pytest.raises(LeaseError, match=rf"^lease of 'a' cannot {verb}: it was already"):
            call()
    assert ls.allocator.num_free == 8 and len(ls) == 0


def test_hand_over_moves_the_references_without_counting_them_again():
    ls = pool()
    a = ls.open("request r", 2)
    b = a.hand_over("room 7")
    assert isinstance(b, Lease) and b.owner == "room 7" and list(b.pages) == [0, 1]
    assert a.state is LeaseState.HANDED_OVER and list(a.pages) == [] and ls.live() == [b]
    assert refs(ls)[:2] == [1, 1] and ls.violations() == []
    with pytest.raises(
        LeaseError,
        match=r"^lease of 'request r' cannot release: it was already handed over to 'room 7'$",
    ):
        a.release()
    b.release()
    assert ls.allocator.num_free == 8 and len(ls) == 0


def test_violations_name_the_page_and_the_counts():
    ls = pool(4)
    a = ls.open("a", 2)
    ls.allocator.retain([1])  # a reference no lease holds: a leak
    a._pages.append(3)  # a page a lease claims without a reference: a use after free
    assert ls.violations() == [
        "page 1: refcount 2, held by 1 leases ['a']",
        "page 3: refcount 0, held by 1 leases ['a']",
    ]


def test_violations_are_capped():
    ls = pool(64)
    ls.allocator.retain(ls.allocator.allocate(30))  # 30 pages no lease holds
    out = ls.violations()
    assert len(out) == 21 and out[0] == "page 0: refcount 2, held by 0 leases []"
    assert out[-1] == "... and 10 more"


def test_drop_of_its_own_page_list_drops_them_all():
    """`drop(lease.pages)`: the argument is the list drop rearranges, so drop copies it."""
    ls = pool(8)
    lease = ls.open("prefix cache", 4)
    lease.drop(lease.pages)
    assert list(lease.pages) == [] and len(lease) == 0
    assert ls.allocator.num_free == 8 and ls.violations() == []


def test_random_sequences_keep_every_count_equal_to_its_holders_and_never_leak():
    """allocate / grow / share / drop / hand over / release / preempt in a seeded random order;
    the model is each live lease's pages (in order until a lease drops some), and after every
    step each page's count is the number of live leases holding it."""
    rng = random.Random(12)
    n = 48
    ls = pool(n)
    model: dict[Lease, list[int]] = {}
    waiting: list[tuple[str, int]] = []  # preempted holders: (owner, pages to take again)
    unordered: set[Lease] = set()  # leases that dropped pages: their order is not kept
    for step in range(4000):
        op = rng.random()
        live = list(model)
        if op < 0.2:  # admit
            k = rng.randint(1, 4)
            if ls.allocator.can_allocate(k):
                lease = ls.open(f"r{step}", k)
                model[lease] = list(lease.pages)
        elif op < 0.4 and live:  # grow as it decodes
            lease = rng.choice(live)
            if ls.allocator.can_allocate(1):
                model[lease] += lease.extend(1)
        elif op < 0.55 and len(live) > 1:  # share another's prefix
            lease, other = rng.sample(live, 2)
            prefix = [p for p in list(other.pages)[: rng.randint(1, 3)] if p not in model[lease]]
            lease.share(prefix)
            model[lease] += prefix
        elif op < 0.65 and live:  # a room keeps a request's pages
            lease = rng.choice(live)
            heir = lease.hand_over(f"room {step}")
            model[heir] = model.pop(lease)
            if lease in unordered:
                unordered.add(heir)
        elif op < 0.75 and live:  # preempt: release now, take pages again later
            lease = rng.choice(live)
            lease.release()
            waiting.append((str(lease.owner), len(model.pop(lease))))
        elif op < 0.85 and waiting and ls.allocator.can_allocate(waiting[0][1]):
            owner, k = waiting.pop(0)
            lease = ls.open(owner, k)
            model[lease] = list(lease.pages)
        elif op < 0.9 and live:  # the cache evicts some of its pages, from anywhere
            lease = rng.choice(live)
            if model[lease]:
                gone = rng.sample(model[lease], rng.randint(1, len(model[lease])))
                lease.drop(gone)
                model[lease] = [p for p in model[lease] if p not in gone]
                unordered.add(lease)
        elif live:  # finish or abort
            lease = rng.choice(live)
            lease.release()
            del model[lease]
            with pytest.raises(LeaseError):
                lease.release()
        holders = [0] * n
        for pages in model.values():
            for p in pages:
                holders[p] += 1
        assert refs(ls) == holders, step
        for lease in ls.live():  # a lease that dropped keeps its page -> place index exact
            index = lease._index
            assert index is None or index == {p: i for i, p in enumerate(lease.pages)}, step
        got = {lease: list(lease.pages) for lease in ls.live()}
        assert {k: sorted(v) if k in unordered else v for k, v in got.items()} == {
            k: sorted(v) if k in unordered else v for k, v in model.items()
        }
        assert ls.allocator.num_used == sum(1 for h in holders if h)
        assert ls.violations() == []
    for lease in list(model):
        lease.release()
    assert ls.allocator.num_free == n and len(ls) == 0 and ls.violations() == []
