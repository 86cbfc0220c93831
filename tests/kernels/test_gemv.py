"""The batch-1 Triton GEMV (kernels/triton_gemv.py) against torch, the SiLU-fused down
projection against silu_mul then the GEMV (bit for bit), and when kernels/ops takes it.

Without a GPU it runs in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from pdserve.attention.triton_common import interpreted  # noqa: E402
from pdserve.kernels import ops, triton_fused, triton_gemv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not interpreted(triton_gemv._gemv_kernel):
    pytest.skip("Triton kernels imported compiled without a GPU", allow_module_level=True)

# (N, K): blocks that do not divide either side, blocks that divide both, qwen's K = 896
SHAPES = [(41, 96), (64, 1024), (24, 896)]
CONFIGS = [None, triton_gemv.Config(2, 64, 4, 2), triton_gemv.Config(16, 32, 2, 3)]


def rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype).to(DEVICE)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_a_float32_product(n, k, bias, config):
    x, w = rand(1, k), rand(n, k, seed=1)
    b = rand(n, seed=2) if bias else None
    got = triton_gemv.gemv(x, w, b, config=config)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == x.dtype and got.shape == (1, n)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("n, k", SHAPES)
def test_the_silu_fused_product_is_silu_mul_then_the_product(n, k, config):
    gate_up, w, b = rand(1, 2 * k, seed=3) * 4, rand(n, k, seed=1), rand(n, seed=2)
    fused = triton_gemv.gemv(gate_up, w, b, silu_mul=True, config=config)
    unfused = triton_gemv.gemv(triton_fused.silu_mul(gate_up), w, b, config=config)
    assert torch.equal(fused, unfused)


def test_ops_takes_it_for_one_16_bit_cuda_row_only():
    x, w = rand(1, 96), rand(40, 96, seed=1)
    assert (ops._gemv(x, w) is not None) == (DEVICE == "cuda")
    assert ops._gemv(rand(2, 96), w) is None  # cuBLAS: no faster kernel measured there
    assert ops._gemv(x.float(), w.float()) is None  # float32 stays on cuBLAS (parity)
    torch.testing.assert_close(
        ops.linear(x, w, None).float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2
    )
    gate_up = rand(1, 192, seed=3)
    torch.testing.assert_close(
        ops.silu_mul_linear(gate_up, w, None).float(),
        F.linear(F.silu(gate_up[:, :96].float()) * gate_up[:, 96:].float(), w.float()),
        atol=2e-2,
        rtol=2e-2,
    )


def test_operands_it_cannot_take_are_refused():
    w = rand(40, 96, seed=1)
    for x, silu in [
        (rand(2, 96), False),  # two rows
        (rand(1, 95), False),  # K mismatch
        (rand(1, 96), True),  # silu_mul wants [1, 2K]
        (rand(1, 96, dtype=torch.float32), False),  # float32
    ]:
        with pytest.raises(ValueError, match="gemv"):
            triton_gemv.gemv(x, w if x.dtype == w.dtype else w.float(), silu_mul=silu)
