"""DeepSeek-V3.2's decode-step indexer on the device (attention/triton_index_scores.py), on the
CPU in Triton's interpreter: the paged scores equal the indexer's own `scores` (HF's math) over
the same keys, in the model-dtype and the fp8 forms; `pick` chooses exactly what
`dsa_indexer.select` chooses, ties included; and the latent kernel over a key list equals the
torch reference over the same picks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pdserve.attention.mla_backend import latent_decode_torch  # noqa: E402
from pdserve.attention.triton_decode import partial_shapes  # noqa: E402
from pdserve.attention.triton_index_scores import paged_index_scores, pick  # noqa: E402
from pdserve.attention.triton_mla_decode import paged_latent_decode  # noqa: E402
from pdserve.model.dsa_indexer import (  # noqa: E402
    Indexer,
    IndexerArch,
    IndexKMode,
    quantize_index_k,
    select,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE, PAGES, ROWS, WIDTH = 4, 32, 5, 6  # a page table of 6 pages: 24 keys a row at most
LENS = [0, 1, 9, 17, 24]  # a padded row, one key, mid-page, past topk, the full table


def paged(seed: int, dim: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """Random index-K pages, each row's own pages (shuffled) and its keys gathered in order."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(PAGES, PAGE, dim, generator=g).to(dtype)
    table = torch.randint(0, PAGES, (ROWS * WIDTH,), generator=g).view(ROWS, WIDTH).int()
    gathered = keys[table.long()].reshape(ROWS, WIDTH * PAGE, dim)
    return keys, table, gathered, g


def indexer(heads: int, dim: int) -> Indexer:
    return Indexer(IndexerArch(64, 32, heads, dim, 8, 12))


@pytest.mark.parametrize(
    "heads, dtype",
    [(4, torch.float32), (16, torch.float32), (16, torch.bfloat16), (16, torch.float16)],
)
def test_the_paged_scores_equal_the_indexers_own(heads: int, dtype: torch.dtype) -> None:
    """float32 index-K, and a 16-bit model's with its query made in that dtype and upcast
    (scoring_query): the kernel's 16-bit dot has every product exact, so the scores are the
    indexer's up to the float32 sums' order."""
    dim = 32
    keys, table, gathered, g = paged(1, dim, dtype)
    ix = indexer(heads, dim)
    q = torch.randn(ROWS, heads, dim, generator=g).to(dtype).float()
    w = torch.randn(ROWS, heads, generator=g)
    lens = torch.tensor(LENS, dtype=torch.int32)
    causal = torch.arange(WIDTH * PAGE)[None, :] < lens[:, None]  # [ROWS, L]
    want = ix.scores(q[:, None], w[:, None], gathered, causal[:, None])[:, 0]
    got = paged_index_scores(
        q.to(DEVICE), w.to(DEVICE), keys.to(DEVICE), None, table.to(DEVICE),
        lens.to(DEVICE), ix.softmax_scale,
    ).cpu()  # fmt: skip
    assert torch.equal(torch.isinf(got), ~causal)
    torch.testing.assert_close(got[causal], want[causal], rtol=1e-5, atol=1e-5)


def test_the_fp8_form_equals_the_indexers_fp8_scores() -> None:
    """fp8 index-K with its per-token scales: the indexer's `scoring_query` and the kernel give
    `scores`' fp8 form (the rotated query quantised per head, the key scale outside)."""
    heads, dim = 16, 32
    _, table, _, g = paged(2, dim, torch.float32)
    raw = torch.randn(PAGES * PAGE, dim, generator=g)
    k8, k_scale = quantize_index_k(raw)  # (the Hadamard rotation does not matter here)
    keys, scales = k8.view(PAGES, PAGE, dim), k_scale.view(PAGES, PAGE, 1)
    ix = indexer(heads, dim)
    q = torch.randn(ROWS, heads, dim, generator=g)
    w = torch.randn(ROWS, heads, generator=g)
    lens = torch.tensor(LENS, dtype=torch.int32)
    causal = torch.arange(WIDTH * PAGE)[None, :] < lens[:, None]
    gathered = keys[table.long()].reshape(ROWS, -1, dim)
    gathered_scales = scales[table.long()].reshape(ROWS, -1)
    want = ix.scores(q[:, None], w[:, None], gathered, causal[:, None], gathered_scales)[:, 0]
    ix.queries = lambda *a: q  # type: ignore[method-assign] # the query under test
    ix.head_weights = lambda *a: w  # type: ignore[method-assign]
    q8, fw, qk_scale = ix.scoring_query(q, q, q, q, IndexKMode.FP8)
    got = paged_index_scores(
        q8.to(DEVICE), fw.to(DEVICE), keys.to(DEVICE), scales.to(DEVICE),
        table.to(DEVICE), lens.to(DEVICE), qk_scale,
    ).cpu()  # fmt: skip
    torch.testing.assert_close(got[causal], want[causal], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_pick_chooses_what_select_chooses_ties_included(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    length, topk = 40, 12
    lens = torch.tensor([0, 3, 12, 13, 40, 27], dtype=torch.int32)
    # Few distinct values: many exact ties at the cut (a 4-head indexer's zeros).
    scores = torch.randint(0, 4, (lens.numel(), length), generator=g).float()
    causal = torch.arange(length)[None, :] < lens[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    keys, counts = pick(scores, lens, topk)
    assert counts.tolist() == [min(topk, n) for n in lens.tolist()]
    want = select(scores, causal, topk)
    for r in range(lens.numel()):
        listed = keys[r, : counts[r]].tolist()
        assert listed == sorted(listed)  # ascending positions
        assert listed == want[r].nonzero().flatten().tolist()
        assert not keys[r, counts[r] :].any()  # past the count: zeros


def test_the_latent_kernel_over_a_key_list_equals_the_reference() -> None:
    g = torch.Generator().manual_seed(5)
    heads, rank, rope = 16, 32, 16
    cache = torch.randn(PAGES, PAGE, 1, rank + rope, generator=g)
    table = torch.randint(0, PAGES, (ROWS * WIDTH,), generator=g).view(ROWS, WIDTH).int()
    lens = torch.tensor(LENS, dtype=torch.int32)
    scores = torch.randn(ROWS, WIDTH * PAGE, generator=g)
    scores = scores.masked_fill(torch.arange(WIDTH * PAGE)[None, :] >= lens[:, None], -torch.inf)
    picked = pick(scores, lens, 7)
    q_latent = torch.randn(ROWS, heads, rank, generator=g)
    q_rope = torch.randn(ROWS, heads, rope, generator=g)
    want = latent_decode_torch(q_latent, q_rope, cache, table, lens, 0.3, picked)
    dev = [t.to(DEVICE) for t in (q_latent, q_rope, cache, table)]
    for splits in (1, 2):
        out = torch.empty(ROWS, heads, rank, device=DEVICE)
        out_shape, lse_shape = partial_shapes(ROWS, heads, splits, rank)
        part = torch.empty(out_shape, device=DEVICE), torch.empty(lse_shape, device=DEVICE)
        lens_, keys = picked[1].to(DEVICE), picked[0].to(DEVICE)
        paged_latent_decode(*dev, lens_, out, 0.3, splits, *part, keys=keys)
        torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(want[0], torch.zeros_like(want[0]))  # the padded row
