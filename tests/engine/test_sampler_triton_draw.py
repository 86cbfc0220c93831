"""The fused Gumbel-max draw (Triton, CUDA's path) picks what the unfused draw picks.

Without a GPU the kernel runs in Triton's CPU interpreter (tests/conftest.py sets it)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pdserve.engine.sampling.random_stream import gumbel_noise, row_key, split_key

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from pdserve.attention.triton_common import interpreted  # noqa: E402
from pdserve.engine.sampling import triton_draw  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not interpreted(triton_draw._gumbel_argmax_kernel):
    pytest.skip("Triton kernels imported compiled without a GPU", allow_module_level=True)


def keys_for(rows: int) -> torch.Tensor:
    return torch.tensor(
        [split_key(row_key(seed, seed + 3)) for seed in range(rows)],
        dtype=torch.int64,
    )


@pytest.mark.parametrize("rows, vocab", [(1, 7), (5, 3000), (3, 2 * triton_draw.BLOCK + 1)])
def test_the_fused_draw_picks_the_unfused_token(rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab)
    z = torch.randn(rows, vocab, generator=g) * 3
    z[:, ::3] = float("-inf")  # filtered out (top-k, top-p): never drawn
    keys = keys_for(rows)
    want = (z + gumbel_noise(keys, vocab)).argmax(dim=-1)
    got = triton_draw.gumbel_argmax(z.to(DEVICE), keys.to(DEVICE)).cpu()
    assert torch.equal(got, want)
    assert all(i % 3 for i in got.tolist())


def test_flat_logits_draw_uniformly():
    """Equal logits: the noise alone decides, so 1,200 draws cover 8 tokens about evenly (150
    each; the bounds are 5 standard deviations)."""
    rows, vocab = 1200, 8
    keys = keys_for(rows)
    got = triton_draw.gumbel_argmax(torch.zeros(rows, vocab, device=DEVICE), keys.to(DEVICE))
    counts = torch.bincount(got.cpu(), minlength=vocab)
    assert counts.min() > 95 and counts.max() < 205, counts
