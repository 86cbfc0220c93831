"""The runner's Batch and the torch backend's metadata, checked against attention computed row
by row.

Decode rows are grouped by KV length (one long row must not pad the short ones); keys are
gathered a page at a time. The reference here reads every key slot by slot from the pool's
strided layer view and runs a plain softmax in float64, so a wrong slot, page order, page
count, mask, group row mapping or prefill context slice shows up as a different output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.attention.torch_backend import group_by_length
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Chunk
from pdserve.protocol.sampling import SamplingParams
from tests.helpers import make_engine


def slot(pages: list[int], pos: int, page_size: int) -> int:
    """The pool slot of token position `pos` of a request holding `pages`."""
    return pages[pos // page_size] * page_size + pos % page_size


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


def reference(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    chunks: list[Chunk],
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Each query row attends to its request's keys at positions 0..its own, slot by slot."""
    ps = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    rows = []
    for c in chunks:
        for pos in range(c.start, c.start + c.length):
            slots = torch.tensor([slot(c.request.pages, i, ps) for i in range(pos + 1)])
            keys = k_cache[slots // ps, slots % ps].double().repeat_interleave(group, dim=1)
            vals = v_cache[slots // ps, slots % ps].double().repeat_interleave(group, dim=1)
            t = len(rows)
            probs = (torch.einsum("hd,khd->hk", q[t].double(), keys) * scale).softmax(-1)
            rows.append(torch.einsum("hk,khd->hd", probs, vals))
    return torch.stack(rows).float()


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_attention_matches_row_by_row_reference(tiny_dir: Path, page_size: int):
    engine = make_engine(tiny_dir, page_size=page_size, chunk=512, kv_mb=8.0)
    pool = engine.pool
    gen = torch.Generator().manual_seed(page_size)
    for i in range(pool.layout.num_layers):  # the pool is bytes: fill its typed K/V views
        for cache in pool.layer(i):
            cache.copy_(torch.randn(cache.shape, generator=gen))
    free = (torch.randperm(pool.num_pages - 1, generator=gen) + 1).tolist()  # page 0: padding

    def request(num_tokens: int) -> Request:
        req = Request(f"r{len(free)}", list(range(num_tokens)), SamplingParams(), lambda out: None)
        req.pages = [free.pop() for _ in range(pool.pages_needed(num_tokens))]
        return req

    # Decodes of very different lengths (several groups; one ends exactly on a page), then a
    # prefill chunk with context already in the pool and a first chunk without any, then
    # one-token chunks after them that are not decodes (with context, and a whole prompt).
    decode_lens = [5, 3 * page_size, 130, 9, 61, 128]
    chunks = [Chunk(request(n), n - 1, 1) for n in decode_lens]
    chunks += [Chunk(request(70), 40, 30), Chunk(request(23), 0, 23)]
    chunks += [Chunk(request(10), 9, 1), Chunk(request(1), 0, 1)]
    assert len(group_by_length(decode_lens, page_size)) > 1

    runner = engine.runner
    batch = runner.build(chunks)
    assert batch.num_decodes == len(decode_lens)
    meta = runner.backend.prepare(batch)
    arch = runner.model.arch
    t = sum(c.length for c in chunks)
    q = torch.randn(t, arch.num_heads, arch.head_dim, generator=gen)
    k = torch.randn(t, arch.num_kv_heads, arch.head_dim, generator=gen)
    v = torch.randn(t, arch.num_kv_heads, arch.head_dim, generator=gen)
    runner.backend.store_kv(1, k, v, meta)
    out = runner.backend.attend(1, q, k, v, meta)
    # store_kv wrote this step's K/V into the pool: the reference reads them there
    k_cache, v_cache = pool.layer(1)  # strided across pages, as the model sees it
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, chunks, arch.head_dim**-0.5))
