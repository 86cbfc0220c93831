"""A worker's pages over its tensor-parallel ranks as the whole model's (kvcache/rank_pages.py):
reading assembles each page from the ranks' heads, writing splits it back, for heads that split
and heads that replicate; the head rule is the parallel layers' own."""

from __future__ import annotations

import pytest
import torch

from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPool
from pdserve.kvcache.rank_pages import RankPages, kv_heads_of, rank_layout
from pdserve.parallel.layers import Part

PAGE, PAGES, LAYERS, DIM = 4, 6, 3, 8


def whole_pool(heads: int, seed: int) -> KVPool:
    pool = KVPool(KVLayout.llama("float32", PAGE, LAYERS, heads, DIM), PAGES, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):
        for name in ("k", "v"):
            view = pool.view(layer, name)
            view.copy_(torch.randn(view.shape, generator=g))
    return pool


def split(whole: KVPool, tp: int) -> list[KVPool]:
    """Each rank's pool as its shard would have written it: its heads of every page."""
    ranks = []
    for r in range(tp):
        pool = KVPool(rank_layout(whole.layout, tp, r), PAGES, torch.device("cpu"))
        heads = list(kv_heads_of(whole.layout.num_kv_heads, tp, r))
        for layer in range(LAYERS):
            for name in ("k", "v"):
                pool.view(layer, name).copy_(whole.view(layer, name)[:, :, heads])
        ranks.append(pool)
    return ranks


class Group:  # what Part.rows reads of a RankGroup
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


@pytest.mark.parametrize("heads, tp", [(4, 1), (4, 2), (4, 4), (2, 4), (1, 2)])
def test_reading_assembles_and_writing_splits(heads: int, tp: int) -> None:
    whole = whole_pool(heads, seed=heads * 10 + tp)
    ranks = split(whole, tp)
    pages = RankPages(whole.layout, [p.data for p in ranks])
    chosen = [5, 0, 3]
    assert torch.equal(torch.stack(pages.read(chosen)), whole.data[chosen])
    # Written into fresh ranks' pools: each holds exactly its heads of those pages.
    fresh = [KVPool(p.layout, PAGES, torch.device("cpu")) for p in ranks]
    into = RankPages(whole.layout, [p.data for p in fresh])
    into.write(chosen, list(whole.data[chosen]))
    for mine, want in zip(fresh, ranks, strict=True):
        assert torch.equal(mine.data[chosen], want.data[chosen])
        others = [p for p in range(PAGES) if p not in chosen]
        assert not mine.data[others].any()  # no other page touched


@pytest.mark.parametrize("heads, tp", [(8, 2), (8, 4), (2, 4), (1, 4), (4, 4)])
def test_the_head_rule_is_the_parallel_layers(heads: int, tp: int) -> None:
    for r in range(tp):
        rows = Part(heads * DIM, heads).rows(Group(r, tp), replicate=True)  # type: ignore[arg-type]
        got = kv_heads_of(heads, tp, r)
        assert range(got.start * DIM, got.stop * DIM) == rows


def test_what_it_refuses() -> None:
    with pytest.raises(ValueError, match="neither split nor replicate"):
        kv_heads_of(3, 2, 0)
    latent = KVLayout.mla("float32", PAGE, LAYERS, 8, 4)  # expert parallel: whole on each rank
    assert rank_layout(latent, 2, 1).buffers == latent.buffers
    assert (rank_layout(latent, 2, 1).tp_rank, rank_layout(latent, 2, 1).tp_size) == (1, 2)
    with pytest.raises(ValueError, match="takes the whole model's layout"):
        rank_layout(rank_layout(latent, 2, 1), 2, 0)
    whole = whole_pool(4, seed=1)
    ranks = split(whole, 2)
    with pytest.raises(ValueError, match="not \\[rows"):
        RankPages(whole.layout, [ranks[0].data, whole.data])
    pages = RankPages(whole.layout, [p.data for p in ranks])
    with pytest.raises(ValueError, match="1 rows for 2 pages"):
        pages.write([0, 1], list(whole.data[:1]))


@pytest.mark.parametrize("heads, p_tp, d_tp", [(4, 2, 1), (4, 1, 2), (2, 2, 4)])
def test_the_data_planes_move_whole_pages_between_layouts(heads: int, p_tp: int, d_tp: int) -> None:
    """shm: P's writer maps each of D's ranks' shared pools and writes their heads; tcp: P's
    copy of its pages, assembled from its ranks, is split over D's ranks. bfloat16 (the 2-byte
    views)."""
    from pdserve.transfer.dataplane import ShmWriter
    from pdserve.transfer.receiver import TcpReceiver

    layout = KVLayout.llama("bfloat16", PAGE, LAYERS, heads, DIM)
    whole = KVPool(layout, PAGES, torch.device("cpu"))
    whole.data.copy_(torch.randint(0, 255, whole.data.shape, dtype=torch.uint8))
    src = RankPages(layout, [p.data for p in split(whole, p_tp)])
    ranks = [KVPool(rank_layout(layout, d_tp, r), PAGES, torch.device("cpu"), shared=True)
             for r in range(d_tp)]  # fmt: skip
    refs = [p.shm for p in ranks if p.shm is not None]
    ShmWriter(refs, layout, PAGES).write(1, 1, src, [4, 1], [0, 5], deadline=0.0)
    rows = src.copy_out([2])  # what TcpWriter sends (D's stager stages the same bytes)
    assert torch.equal(rows, whole.data[[2]])
    rx = TcpReceiver(RankPages(layout, [p.data for p in ranks]))
    assert rx.accept_rows(1, 1, [3], rows.clone()) == layout.page_bytes
    got = RankPages(layout, [p.data for p in ranks])
    assert torch.equal(torch.stack(got.read([0, 5, 3])), whole.data[[4, 1, 2]])
    for r, mine in enumerate(ranks):  # each rank's own heads, nothing else
        assert torch.equal(mine.data[[0, 5, 3]], split(whole, d_tp)[r].data[[4, 1, 2]])
        assert not mine.data[[1, 2, 4]].any()


def test_a_latent_page_is_read_from_rank_0_and_written_to_every_rank() -> None:
    latent = KVLayout.mla("bfloat16", PAGE, LAYERS, 8, 4)
    ranks = [KVPool(rank_layout(latent, 3, r), PAGES, torch.device("cpu")) for r in range(3)]
    pages = RankPages(latent, [p.data for p in ranks])
    rows = [torch.full((latent.page_bytes,), 7 + i, dtype=torch.uint8) for i in range(2)]
    pages.write([4, 1], rows)
    for pool in ranks:  # each rank's copy, whole
        assert torch.equal(pool.data[[4, 1]], torch.stack(rows))
    ranks[1].data[4] = 0  # a rank's copy is not read: rank 0's is
    assert torch.equal(torch.stack(pages.read([4, 1])), torch.stack(rows))


def test_data_parallel_pages_live_whole_in_one_ranks_pool() -> None:
    """`dp`: page g is row g % PAGES of rank g // PAGES's pool, and only there."""
    latent = KVLayout.mla("bfloat16", PAGE, LAYERS, 8, 4)
    ranks = [KVPool(rank_layout(latent, 2, r), PAGES, torch.device("cpu")) for r in range(2)]
    pages = RankPages(latent, [p.data for p in ranks], dp=True)
    assert pages.num_pages == 2 * PAGES
    rows = [torch.full((latent.page_bytes,), 9 + i, dtype=torch.uint8) for i in range(3)]
    pages.write([PAGES + 4, 1, PAGES], rows)
    assert torch.equal(ranks[1].data[4], rows[0]) and torch.equal(ranks[0].data[1], rows[1])
    assert torch.equal(ranks[1].data[0], rows[2])
    assert not ranks[0].data[4].any() and not ranks[1].data[1].any()  # nowhere else
    assert torch.equal(torch.stack(pages.read([1, PAGES + 4])), torch.stack([rows[1], rows[0]]))
    with pytest.raises(ValueError, match=f"page {2 * PAGES} is not one of {2 * PAGES}"):
        pages.read([2 * PAGES])
    heads = KVLayout.llama("float32", PAGE, LAYERS, 4, DIM)
    with pytest.raises(ValueError, match="pages are whole, without state"):
        RankPages(heads, [KVPool(rank_layout(heads, 2, r), PAGES, torch.device("cpu")).data
                          for r in range(2)], dp=True)  # fmt: skip
