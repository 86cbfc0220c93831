"""A peer may map only a pdserve KV pool, named by its owner's pid, fd and token: never a path."""

from __future__ import annotations

import os
import re
from dataclasses import replace

import pytest
import torch

from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPool, PoolRefused, ShmRef, map_shared

LAYOUT = KVLayout.llama("float32", page_size=4, num_layers=2, num_kv_heads=2, head_dim=8)


@pytest.fixture
def pool():
    p = KVPool(LAYOUT, 6, torch.device("cpu"), shared=True)
    yield p
    p.close()


def test_the_owner_s_pool_maps_and_shares_bytes(pool):
    assert pool.shm is not None and re.fullmatch(r"[0-9a-f]{32}", pool.shm.token)
    peer = map_shared(pool.shm, LAYOUT, 6)  # the peer sees bytes [pages, page_bytes]
    assert peer.dtype == torch.uint8 and peer.shape == (6, LAYOUT.page_bytes)
    k, v = pool.layer(1)
    v[3].fill_(2.5)  # the owner writes through a typed view ...
    r = LAYOUT.region(1, "v")
    assert torch.equal(peer[3, r.offset : r.offset + r.nbytes].view(torch.float32), v[3].flatten())
    peer[4].fill_(7)  # ... and the peer's bytes show through the owner's views
    assert torch.equal(pool.page(4), torch.full_like(pool.page(4), 7))
    assert bool((k[4].view(torch.uint8) == 7).all())


def test_any_other_file_is_refused_and_left_untouched(pool, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 1000)
    fd = os.open(victim, os.O_RDWR)
    try:
        # The same size as the pool would not help either: it is not a pdserve pool.
        os.truncate(victim, 6 * LAYOUT.page_bytes)
        ref = ShmRef(os.getpid(), fd, pool.shm.token)
        with pytest.raises(PoolRefused) as e:
            map_shared(ref, LAYOUT, 6)
        assert str(victim) not in str(e.value) and "victim" not in str(e.value)
    finally:
        os.close(fd)
    assert victim.read_bytes()[:8] == b"precious"


def test_the_right_pool_with_a_wrong_token_is_refused(pool):
    wrong = replace(pool.shm, token="0" * 32)
    with pytest.raises(PoolRefused):
        map_shared(wrong, LAYOUT, 6)


@pytest.mark.parametrize(
    "field,value",
    [("token", "../../etc/passwd"), ("token", "A" * 32), ("pid", -1), ("pid", 2**40), ("fd", -3)],
)
def test_malformed_references_are_refused(pool, field, value):
    with pytest.raises(PoolRefused, match="malformed"):
        map_shared(replace(pool.shm, **{field: value}), LAYOUT, 6)


def test_a_size_mismatch_says_so_without_numbers(pool):
    with pytest.raises(PoolRefused) as e:
        map_shared(pool.shm, LAYOUT, 7)
    assert not re.search(r"\d{3,}", str(e.value))  # no byte counts of what was opened


def test_a_closed_or_missing_descriptor_is_refused(pool):
    with pytest.raises(PoolRefused):
        map_shared(replace(pool.shm, fd=987654), LAYOUT, 6)
