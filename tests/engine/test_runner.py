"""The runner's decode grouping: rows of similar KV length share one padded attention batch."""

from __future__ import annotations

import torch

from pdserve.engine.runner import group_by_length
from pdserve.model.attention import AttentionContext, DecodeGroup, paged_attention


def test_groups_cover_every_row_once_and_at_most_double_the_padding():
    lens = [100, 150, 1040, 17, 33, 260, 990, 1, 16, 2048]
    groups = group_by_length(lens, page_size=16)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    pages = [-(-n // 16) for n in lens]
    for g in groups:
        longest = max(pages[i] for i in g)
        assert pages[g[0]] == longest
        assert all(2 * pages[i] > longest for i in g), (g, [pages[i] for i in g])
    # one long row does not pad the short ones: it gets a group of its own
    assert group_by_length([100, 150, 120, 1040], 16) == [[3], [1, 2, 0]]
    assert group_by_length([40, 40, 40], 16) == [[0, 1, 2]]


def _layout(lens, page_size=4, heads=4, kv_heads=2, dim=8):
    g = torch.Generator().manual_seed(0)
    num_pages = sum(-(-n // page_size) for n in lens) + 1
    k_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=g)
    perm = torch.randperm(num_pages - 1, generator=g) + 1  # page 0 stays unused: padding
    tables, at = [], 0
    for n in lens:
        tables.append(perm[at : at + -(-n // page_size)])
        at += len(tables[-1])
    q = torch.randn(len(lens), heads, dim, generator=g)
    new_k = torch.randn(len(lens), kv_heads, dim, generator=g)
    new_v = torch.randn(len(lens), kv_heads, dim, generator=g)
    slots = torch.tensor(
        [
            int(t[(n - 1) // page_size]) * page_size + (n - 1) % page_size
            for t, n in zip(tables, lens, strict=True)
        ]
    )
    return k_cache, v_cache, tables, q, new_k, new_v, slots


def _group(rows, lens, tables, page_size, index):
    max_pages = max(len(tables[i]) for i in rows)
    pages = torch.zeros(len(rows), max_pages, dtype=torch.long)
    for j, i in enumerate(rows):
        pages[j, : len(tables[i])] = tables[i]
    pos = torch.arange(max_pages * page_size)
    mask = (pos[None, :] < torch.tensor([lens[i] for i in rows])[:, None])[:, None, None, :]
    return DecodeGroup(torch.tensor(rows) if index else None, pages, mask)


def test_grouped_decode_attention_equals_one_padded_batch():
    lens, ps = [5, 9, 61, 3, 40], 4
    k_cache, v_cache, tables, q, k, v, slots = _layout(lens, ps)
    one = AttentionContext(slot_mapping=slots, num_decode=len(lens))
    one.decode_groups = [_group(list(range(len(lens))), lens, tables, ps, index=False)]
    ref = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), one, 8**-0.5)
    groups = group_by_length(lens, ps)
    assert len(groups) > 1
    split = AttentionContext(slot_mapping=slots, num_decode=len(lens))
    split.decode_groups = [_group(g, lens, tables, ps, index=True) for g in groups]
    out = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), split, 8**-0.5)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
