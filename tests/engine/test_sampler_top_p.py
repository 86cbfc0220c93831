"""top_p by radix select (Triton, CUDA's path) keeps exactly what the sorted reference keeps.

Without a GPU the kernel runs in Triton's CPU interpreter (tests/conftest.py sets it)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pdserve.engine.sampling.processors import filter_top_p_sorted

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from pdserve.attention.triton_common import interpreted  # noqa: E402
from pdserve.engine.sampling import triton_top_p  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not interpreted(triton_top_p._top_p_kernel):
    pytest.skip("Triton kernels imported compiled without a GPU", allow_module_level=True)

NEG_INF = float("-inf")


def both(z: torch.Tensor, rows: list[int], ps: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, kernel) results of filtering copies of z."""
    r = torch.tensor(rows, dtype=torch.int64)
    p = torch.tensor(ps, dtype=torch.float32)[:, None]
    want = z.clone()
    filter_top_p_sorted(want, r, p)
    got = z.clone().to(DEVICE)
    triton_top_p.filter_top_p_(got, r.to(DEVICE), p.to(DEVICE))
    return want, got.cpu()


@pytest.mark.parametrize("vocab", [7, 1000, 2 * triton_top_p.BLOCK + 3])
def test_random_rows_keep_what_the_sort_keeps(vocab) -> None:
    g = torch.Generator().manual_seed(vocab)
    z = torch.randn(6, vocab, generator=g) * 2.5
    z[1, ::4] = NEG_INF  # filtered out before (min_p, top_k)
    z[2] = -z[2].abs()  # every logit negative
    z[3, 0] = 40.0  # one token holds all the mass: it alone stays
    want, got = both(z, [0, 1, 2, 3, 5], [0.9, 0.5, 0.95, 0.9, 0.1])
    assert torch.equal(want.isinf(), got.isinf())
    assert torch.equal(want, got)
    assert torch.equal(got[4], z[4])  # a row without top_p is untouched
    kept = (~got[3].isinf()).sum().item()
    assert kept == 1


def test_ties_at_the_cut_keep_the_lowest_token_ids() -> None:
    g = torch.Generator().manual_seed(1)
    z = (torch.randn(8, 600, generator=g) * 2).round() / 2  # many exact ties
    z[:, 100:140] = 1.0  # a wide tie group around the middle of the mass
    z[7] = 0.0  # a flat row: every token ties; -0.0 counts as 0.0
    z[7, 5] = -0.0
    ps = [0.3, 0.5, 0.7, 0.9, 0.99, 0.37, 0.61, 0.25]
    want, got = both(z, list(range(8)), ps)
    assert torch.equal(want.isinf(), got.isinf())
    flat_kept = (~got[7].isinf()).nonzero().flatten()
    assert flat_kept.tolist() == list(range(len(flat_kept)))  # a prefix of the ids
    assert 0 < len(flat_kept) < 600


def test_top_p_near_one_keeps_every_token_with_mass() -> None:
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 500, generator=g)
    z[1, 250:] = NEG_INF
    want, got = both(z, [0, 1], [0.9999999, 0.9999999])
    assert torch.equal(want.isinf(), got.isinf())
