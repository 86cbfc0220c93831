"""How a nixl write's pages become descriptors: pairs consecutive on both sides merge.

`page_spans` is pure and runs everywhere. The last test writes merged spans between two NIXL
agents inside this process (loopback over UCX, no child process) and checks every byte and
the descriptor count the write reports.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from pdserve.kvcache.allocator import PageAllocator
from pdserve.kvcache.pool import KVPool
from pdserve.transfer.nixl import (
    NixlAgent,
    NixlWriter,
    Span,
    nixl_available,
    page_spans,
    run_indices,
    span_starts,
)
from tests.kvcache.layouts import fill_random, layout


def expand(spans: list[Span]) -> tuple[list[int], list[int]]:
    src = [s.src + i for s in spans for i in range(s.pages)]
    dst = [s.dst + i for s in spans for i in range(s.pages)]
    return src, dst


def test_consecutive_on_both_sides_is_one_span():
    assert page_spans(range(4, 9), range(20, 25)) == [Span(4, 20, 5)]
    assert page_spans([7], [0]) == [Span(7, 0, 1)]
    assert page_spans([], []) == []


def test_a_break_on_either_side_starts_a_new_span():
    # src consecutive, dst jumps after 2 | dst consecutive, src jumps after 3 | both go down
    assert page_spans([0, 1, 2, 3], [5, 6, 9, 10]) == [Span(0, 5, 2), Span(2, 9, 2)]
    assert page_spans([0, 1, 2, 8], [3, 4, 5, 6]) == [Span(0, 3, 3), Span(8, 6, 1)]
    assert page_spans([3, 2, 1], [3, 2, 1]) == [Span(3, 3, 1), Span(2, 2, 1), Span(1, 1, 1)]


def test_a_repeated_page_never_merges():
    """Same page twice (or a step of 0 on one side) is two descriptors, not a longer run."""
    assert page_spans([5, 5], [1, 2]) == [Span(5, 1, 1), Span(5, 2, 1)]
    assert page_spans([1, 2], [4, 4]) == [Span(1, 4, 1), Span(2, 4, 1)]


def test_random_lists_round_trip_and_spans_are_maximal():
    rng = random.Random(3)
    for _ in range(300):
        n = rng.randint(1, 40)
        src = [rng.choice([0, 1, 1, 1, 2]) for _ in range(n)]  # mostly runs, some breaks
        dst = [rng.choice([1, 1, 1, 7]) for _ in range(n)]
        src = [sum(src[: i + 1]) + 100 * (i % 3 == 0 and rng.random() < 0.2) for i in range(n)]
        dst = [sum(dst[: i + 1]) for i in range(n)]
        spans = page_spans(src, dst)
        assert expand(spans) == (src, dst)  # every pair once, in order
        assert sum(s.pages for s in spans) == n
        for a, b in zip(spans, spans[1:], strict=False):  # no two neighbours could merge
            assert not (b.src == a.src + a.pages and b.dst == a.dst + a.pages)
        assert len(span_starts(run_indices(src), run_indices(dst))) == len(spans)


def test_unequal_lists_are_refused():
    with pytest.raises(ValueError, match=r"^3 source pages for 2 destination pages$"):
        page_spans([1, 2, 3], [1, 2])


def test_fresh_allocators_on_both_sides_give_one_span():
    p, d = PageAllocator(64), PageAllocator(64)
    d.allocate(5)  # D already serves someone: its run starts elsewhere
    assert len(page_spans(p.allocate(20), d.allocate(20))) == 1


@pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
def test_merged_spans_land_exactly_and_are_counted():
    lay = layout("bfloat16")
    src, dst = KVPool(lay, 16, torch.device("cpu")), KVPool(lay, 16, torch.device("cpu"))
    fill_random(src, 1)
    p = NixlAgent(f"spans-p-{time.monotonic_ns()}", src)
    d = NixlAgent(f"spans-d-{time.monotonic_ns()}", dst)
    writer = NixlWriter(p, d.descriptor(), lay, 16)
    try:
        sp, dp = [3, 4, 5, 9, 10, 0, 15], [0, 1, 2, 7, 8, 12, 13]  # spans 3 + 2 + 1 + 1
        x = writer.write(4, 1, src, sp, dp, time.monotonic() + 10)
        end = time.monotonic() + 10
        landed: list[tuple[int, int, int]] = []
        while not (x.poll() and landed):
            assert time.monotonic() < end, "the write did not complete"
            landed += d.landed()
            time.sleep(0.001)
        assert x.descriptors == 4 and landed == [(4, 1, 7 * lay.page_bytes)]
        for s, t in zip(sp, dp, strict=True):
            assert torch.equal(dst.page(t), src.page(s))
        untouched = [q for q in range(16) if q not in dp]
        assert not dst.data[untouched].any()
    finally:
        writer.close()
