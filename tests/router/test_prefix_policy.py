"""Cache-aware routing (`--policy prefix`): the index and the policy, pure, exact, milliseconds."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdserve.protocol.page_keys import page_key, page_keys
from pdserve.router.policy import PrefixAware, PrefixSettings, make_policy
from pdserve.router.prefix_index import PrefixIndex, fleet_page_size
from pdserve.router.registry import Registry

PS = 4  # tokens a page in these tests


@dataclass
class W:
    index: int
    outstanding: int = 0


def prompt(*blocks: int, tail: int = 0) -> list[int]:
    """Whole pages of token ids 1000*b + i, then `tail` more tokens (a partial page)."""
    out = [1000 * b + i for b in blocks for i in range(PS)]
    return out + [7] * tail


def policy(max_imbalance: int = 2, index_pages: int = 1000) -> PrefixAware:
    return PrefixAware(PrefixSettings(PS, index_pages, max_imbalance))


def test_page_keys_chain_like_the_workers_cache_and_skip_a_partial_page():
    ids = prompt(1, 2, tail=3)
    keys = page_keys(ids, PS)
    assert len(keys) == 2
    first = page_key(0, tuple(ids[:PS]))
    assert keys == [first, page_key(first, tuple(ids[PS : 2 * PS]))]
    # The same page after a different prefix is a different key: the chain, not the page.
    assert page_keys(prompt(3, 2), PS)[1] != keys[1]
    assert page_keys(ids[: PS - 1], PS) == []
    with pytest.raises(ValueError, match="page_size"):
        page_keys(ids, 0)


def test_index_matches_the_longest_run_from_the_first_page():
    idx = PrefixIndex(100)
    idx.insert(page_keys(prompt(1, 2, 3), PS))
    assert idx.match(page_keys(prompt(1, 2, 3, 4), PS)) == 3
    assert idx.match(page_keys(prompt(1, 2, 9), PS)) == 2
    assert idx.match(page_keys(prompt(2, 3), PS)) == 0  # the right pages after the wrong head
    assert len(idx) == 3
    idx.insert(page_keys(prompt(1, 2, 5), PS))  # shares two pages: one new key
    assert len(idx) == 4


def test_index_evicts_least_recently_sent_and_chains_lose_their_tails_first():
    idx = PrefixIndex(4)
    idx.insert(page_keys(prompt(1, 2), PS))
    idx.insert(page_keys(prompt(3, 4), PS))
    idx.insert(page_keys(prompt(1, 2), PS))  # 1-2 now more recent than 3-4
    idx.insert(page_keys(prompt(5), PS))  # over capacity: 3-4 loses its tail (4) first
    assert (len(idx), idx.evicted) == (4, 1)
    assert idx.match(page_keys(prompt(3, 4), PS)) == 1
    assert idx.match(page_keys(prompt(1, 2), PS)) == 2
    # A prompt longer than the whole index keeps its head, not its tail.
    big = PrefixIndex(3)
    big.insert(page_keys(prompt(1, 2, 3, 4, 5), PS))
    assert big.match(page_keys(prompt(1, 2, 3, 4, 5), PS)) == 3
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(0)


def test_repeated_prefix_goes_back_to_the_same_worker():
    pol, ws = policy(), [W(0), W(1), W(2)]
    first = pol.choose("decode", ws, prompt(1, 2, 3)).index
    # Other conversations spread (no match anywhere: least-outstanding, ties in turn).
    others = [pol.choose("decode", ws, prompt(b)).index for b in (10, 11)]
    assert sorted([first, *others]) == [0, 1, 2]
    for b in (4, 5, 6):  # the conversation grows: each turn extends the last prompt
        assert pol.choose("decode", ws, prompt(1, 2, 3, b)).index == first
    assert pol.counts.by_prefix == 3 and pol.counts.no_match == 3


def test_longest_match_wins_and_equal_matches_go_to_the_least_loaded():
    pol, ws = policy(max_imbalance=5), [W(0), W(1)]
    pol.choose("decode", [ws[0]], prompt(1))  # w0 holds 1
    pol.choose("decode", [ws[1]], prompt(1, 2))  # w1 holds 1-2
    assert pol.expected_match("decode", 0, prompt(1, 2, 3)) == 1
    assert pol.expected_match("decode", 1, prompt(1, 2, 3)) == 2
    ws[1].outstanding = 3  # busier, within the allowed imbalance: the longer match still wins
    assert pol.choose("decode", ws, prompt(1, 2, 3)).index == 1
    # A shared system prompt both hold: an equal match, so the load decides.
    assert pol.choose("decode", ws, prompt(1, 9)).index == 0


def test_an_overloaded_holder_loses_to_the_least_loaded_which_learns_the_prefix():
    pol, ws = policy(max_imbalance=2), [W(0), W(1), W(2, outstanding=1)]
    assert pol.choose("decode", ws, prompt(1, 2)).index == 0
    ws[0].outstanding = 2  # 2 beyond the least loaded: still allowed
    assert pol.choose("decode", ws, prompt(1, 2, 3)).index == 0
    ws[0].outstanding = 3  # 3 beyond: the least loaded (w1) wins
    assert pol.choose("decode", ws, prompt(1, 2, 3, 4)).index == 1
    assert pol.counts.by_load == 1
    assert pol.expected_match("decode", 1, prompt(1, 2, 3, 4)) == 4
    # Both hold it now; w1 is the less loaded.
    assert pol.choose("decode", ws, prompt(1, 2, 3, 4)).index == 1
    assert pol.expected_match("decode", 2, prompt(1)) == 0


def test_no_full_page_or_no_prompt_is_least_outstanding_and_learns_nothing():
    pol, ws = policy(), [W(0, 1), W(1)]
    assert pol.choose("decode", ws, prompt(tail=PS - 1)).index == 1
    assert pol.choose("decode", ws).index == 1
    assert pol.counts.no_prompt == 2
    assert pol.state("decode", 1) == {"prefix_index_pages": 0}


def test_pools_have_separate_indexes_and_a_forgotten_worker_starts_cold():
    pol, ws = policy(), [W(0), W(1)]
    pol.choose("prefill", ws, prompt(1, 2))
    holder = pol._last["prefill"]
    assert pol.expected_match("prefill", holder, prompt(1, 2)) == 2
    assert pol.expected_match("decode", holder, prompt(1, 2)) == 0
    assert pol.state("prefill", holder) == {"prefix_index_pages": 2}
    pol.forget("prefill", holder)
    assert pol.expected_match("prefill", holder, prompt(1, 2)) == 0
    assert pol.state("prefill", holder) == {"prefix_index_pages": 0}


def test_index_capacity_bounds_each_worker():
    pol, ws = policy(index_pages=3), [W(0)]
    for b in range(10):
        pol.choose("decode", ws, prompt(100 + b, 200 + b))
    assert pol.state("decode", 0) == {"prefix_index_pages": 3}


def test_settings_are_validated_and_make_policy_passes_them():
    for bad in ({"page_size": 0}, {"index_pages": 0}, {"max_imbalance": -1}):
        with pytest.raises(ValueError, match="prefix routing"):
            PrefixSettings(**bad)  # type: ignore[arg-type]
    pol = make_policy("prefix", PrefixSettings(PS, 10, 3))
    assert isinstance(pol, PrefixAware) and pol.settings.max_imbalance == 3
    assert make_policy("prefix").stats()["page_size"] == 16


def test_fleet_page_size_comes_from_the_workers_layout():
    assert fleet_page_size([{"layout": {"page_size": 32}}, {"layout": {"page_size": 16}}]) == 16
    assert fleet_page_size([{"layout": {"page_size": 32}}, {}]) == 32
    assert fleet_page_size([{}, {"layout": {"page_size": True}}]) == 16  # the engine default


def registry(n_p: int, n_d: int) -> Registry:
    pol = make_policy("prefix", PrefixSettings(PS, 1000, 1))
    return Registry.build(
        [(f"http://d{i}", {}) for i in range(n_d)],
        [(f"http://p{i}", {"control": f"tcp://p{i}:1"}) for i in range(n_p)],
        pol,
    )


def test_colocated_registry_routes_a_conversation_to_one_worker():
    reg = registry(0, 2)
    a = reg.choose(prompt=prompt(1, 2))
    reg.acquire(a)
    # In flight on a: a new conversation goes to the idle worker.
    b = reg.choose(prompt=prompt(3))
    assert b.decode is not a.decode
    reg.acquire(b)
    reg.acquire(reg.choose(prompt=prompt(1, 2, 3)))  # a's conversation: back to a
    assert a.decode.outstanding == 2 and a.decode.routed == 2
    # a is 1 beyond b: allowed; 2 beyond: the load wins.
    a.decode.outstanding = 3
    assert reg.choose(prompt=prompt(1, 2, 3, 4)).decode is b.decode
    snap = reg.snapshot()
    assert snap["policy"] == "prefix" and snap["policy_stats"]["routed"]["by_load"] == 1
    pages = {w["url"]: w["prefix_index_pages"] for w in snap["workers"]}
    assert pages == {a.decode.url: 3, b.decode.url: 5}  # b: its own page, and 1-2-3-4 learned


def test_pd_registry_keeps_the_index_on_prefill_and_picks_decode_by_load():
    reg = registry(2, 2)
    first = reg.choose(prompt=prompt(1, 2))
    assert first.prefill is not None
    reg.acquire(first)
    for b in (3, 4):
        r = reg.choose(prompt=prompt(1, 2, b))
        assert r.prefill is first.prefill  # P holds the cache
        assert r.decode is not first.decode  # D by load: the idle one
    snap = {w["url"]: w for w in reg.snapshot()["workers"]}
    assert snap[first.prefill.url]["prefix_index_pages"] == 4
    assert snap[first.decode.url]["prefix_index_pages"] == 0  # D keeps no index
    # P leaves rotation: its index goes; back, it starts cold, so load decides again.
    reg.mark_worker(first.prefill.url, False, "gone", now=1.0)
    assert reg.choose(prompt=prompt(1, 2)).prefill is not first.prefill
    reg.mark_worker(first.prefill.url, True, None, now=2.0)
    snap = {w["url"]: w for w in reg.snapshot()["workers"]}
    assert snap[first.prefill.url]["prefix_index_pages"] == 0
