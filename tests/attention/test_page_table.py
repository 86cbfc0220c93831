"""Persistent page-table rows (attention/page_table.py): synced by appends, rewritten when the
list changes, reused after release, and a Batch built from them is the one built from scratch."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pdserve.attention.batch import BatchBuilder, SeqSpan
from pdserve.attention.page_table import MIN_ROWS, MIN_WIDTH, PageTable


class Owner:
    """A sequence's identity (the runner's Request); `done` as Request.status.finished."""

    def __init__(self, done: bool = False) -> None:
        self.done = done


def gathered(table: PageTable, slots: list[int], need: list[int], width: int) -> list:
    out = np.zeros((len(slots), width), dtype=np.int32)
    table.gather(slots, np.array(need), out)
    return out.tolist()


def test_a_page_appended_mid_run_is_written_and_padding_stays_zero():
    table, a = PageTable(), Owner()
    pages = [7, 3]
    slot = table.sync(a, pages, need=2)
    assert table.row(a) == [7, 3]
    pages.append(9)  # the lease grew (Lease.extend appends to the same list)
    assert table.sync(a, pages, need=3) == slot
    assert table.row(a) == [7, 3, 9]
    assert gathered(table, [slot], [2], 4) == [[7, 3, 0, 0]]  # past `need`: zeros
    assert gathered(table, [slot], [3], 4) == [[7, 3, 9, 0]]


def test_a_new_or_shorter_list_rewrites_the_row():
    table, a = PageTable(), Owner()
    table.sync(a, [1, 2, 3], need=3)
    table.sync(a, [8, 9], need=2)  # preempted and given a new lease: another list
    assert table.row(a) == [8, 9]
    pages = [4, 5, 6]
    table.sync(a, pages, need=3)
    pages[:] = [6]  # the same list, shorter
    table.sync(a, pages, need=1)
    assert table.row(a) == [6]


def test_a_released_slot_is_reused_without_the_old_pages():
    table, a, b = PageTable(), Owner(), Owner()
    slot = table.sync(a, [5, 6, 7, 8], need=4)
    table.release(a)
    table.release(a)  # twice: nothing more
    assert len(table) == 0 and table.slot_of(a) is None
    assert table.sync(b, [9], need=1) == slot  # the freed slot, rewritten
    assert table.row(b) == [9]
    assert gathered(table, [slot], [1], 4) == [[9, 0, 0, 0]]


def test_too_few_pages_are_refused():
    with pytest.raises(ValueError, match="needs 3 pages, it holds 2"):
        PageTable().sync(Owner(), [1, 2], need=3)


def test_the_table_takes_back_finished_owners_before_it_grows_and_widens():
    table = PageTable(gone=lambda o: isinstance(o, Owner) and o.done)
    owners = [Owner() for _ in range(MIN_ROWS)]
    for i, o in enumerate(owners):
        table.sync(o, [i], need=1)
    owners[3].done = True  # finished, never released
    late = Owner()
    assert table.sync(late, [99], need=1) == 3  # its slot, not a new row
    assert table.slot_of(owners[3]) is None
    more = Owner()
    slot = table.sync(more, list(range(MIN_WIDTH + 5)), need=MIN_WIDTH + 5)  # grows, widens
    assert slot >= MIN_ROWS and table.row(more) == list(range(MIN_WIDTH + 5))
    assert all(table.row(o) == [i] for i, o in enumerate(owners) if i != 3)


def test_persistent_rows_build_the_batch_a_fresh_builder_builds():
    """Random steps: sequences join, decode (pages appended as they cross a page), are
    preempted (a new page list) and leave; every Batch equals the one built with no
    persistent rows."""
    ps, rng = 4, random.Random(7)
    cpu = torch.device("cpu")
    kept, fresh = BatchBuilder(ps, 4096, cpu), BatchBuilder(ps, 4096, cpu)
    free = list(range(1, 4096))
    live: dict[Owner, tuple[list[int], int]] = {}  # owner -> (pages, tokens in the pool)
    for _ in range(60):
        for o in [o for o in live if rng.random() < 0.1]:
            kept.release(o)  # it left
            del live[o]
        for o in [o for o in live if rng.random() < 0.05]:
            live[o] = ([free.pop() for _ in live[o][0]], live[o][1])  # preempted: new list
        while len(live) < 70 and rng.random() < 0.7:
            live[Owner()] = ([], rng.randrange(0, 40))
        spans = []
        for o, (pages, start) in live.items():
            while len(pages) * ps < start + 1:
                pages.append(free.pop())  # a page appended mid-run
            spans.append(SeqSpan([rng.randrange(100)], start, pages, rng.random() < 0.9, o))
            live[o] = (pages, start + 1)
        spans.append(SeqSpan([1, 2, 3], 0, [free[-1]], True))  # and a prefill
        a = kept.build(spans)
        b = fresh.build([s._replace(owner=None) for s in spans])
        for field in ("input_ids", "positions", "slot_mapping", "query_start", "query_lens"):
            assert getattr(a, field).tolist() == getattr(b, field).tolist(), field
        for field in ("kv_lens", "page_table", "sample_indices"):
            assert getattr(a, field).tolist() == getattr(b, field).tolist(), field
        width = a.page_table.shape[1]
        need = [-(-(s.start + len(s.token_ids)) // ps) for s in spans]
        assert a.page_table.tolist() == [
            list(s.pages[:n]) + [0] * (width - n) for s, n in zip(spans, need, strict=True)
        ]
        assert (a.num_decodes, a.host_query_start, a.host_kv_lens) == (
            b.num_decodes,
            b.host_query_start,
            b.host_kv_lens,
        )
    assert len(fresh.table) == 0  # rows for one build only are given back
    assert len(kept.table) == len(live)
