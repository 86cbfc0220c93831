"""worker/http/aborted_ids.py: aborted ids kept for a while, in a bounded table."""

from __future__ import annotations

from pdserve.worker.http.aborted_ids import AbortedIds


def test_an_aborted_id_is_refused_until_it_expires():
    ids = AbortedIds(keep_s=10.0)
    ids.add("a", now=100.0)
    assert ids.refuse("a", now=105.0) and not ids.refuse("b", now=105.0)
    assert not ids.refuse("a", now=110.5) and len(ids) == 0 and ids.refused == 1


def test_a_second_abort_renews_an_id_and_expiry_follows_time_order():
    ids = AbortedIds(keep_s=10.0)
    ids.add("a", now=0.0)
    ids.add("b", now=5.0)
    ids.add("a", now=8.0)  # renewed: now the newest
    assert ids.refuse("a", now=14.0) and ids.refuse("b", now=14.0)
    assert not ids.refuse("b", now=15.5) and ids.refuse("a", now=15.5)


def test_the_table_is_bounded_oldest_first():
    ids = AbortedIds(keep_s=1e9, cap=3)
    for n, rid in enumerate("abcd"):
        ids.add(rid, now=float(n))
    assert len(ids) == 3 and not ids.refuse("a", now=4.0) and ids.refuse("d", now=4.0)
