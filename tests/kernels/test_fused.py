"""The fused layer kernels (Triton) against the torch reference the CPU runs.

Without a GPU they run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET);
on the GPU, compiled, at the same shapes. float32 agrees to rounding; bfloat16 to one step of
its precision (the interpreter converts float32 to bfloat16 by truncating, the GPU rounds).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pdserve.kernels import reference

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from pdserve.attention.triton_common import interpreted  # noqa: E402
from pdserve.kernels import triton_fused  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not interpreted(triton_fused._rms_norm_kernel):
    pytest.skip("Triton kernels imported compiled without a GPU", allow_module_level=True)

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}


def rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, dim", [(1, 64), (5, 96), (3, 896)])
def test_rms_norm_and_the_fused_residual_add(dtype, rows, dim):
    x, res, w = (
        rand(rows, dim, dtype=dtype),
        rand(rows, dim, dtype=dtype, seed=1),
        rand(dim, dtype=dtype, seed=2),
    )
    torch.testing.assert_close(
        triton_fused.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), **TOL[dtype]
    )
    want_out, want_sum = reference.add_rms_norm(x, res, w, 1e-6)
    residual = res.clone()
    out = triton_fused.rms_norm(x, w, 1e-6, residual)
    torch.testing.assert_close(residual, want_sum, **TOL[dtype])  # updated in place
    torch.testing.assert_close(out, want_out, **TOL[dtype])


def test_rms_norm_reads_strided_rows():
    x = rand(4, 128, dtype=torch.float32)[:, :64]  # rows 128 apart
    w = rand(64, dtype=torch.float32, seed=3)
    torch.testing.assert_close(triton_fused.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, inter", [(1, 8), (3, 704), (2, 1500)])
def test_silu_mul(dtype, rows, inter):
    gate_up = rand(rows, 2 * inter, dtype=dtype)
    torch.testing.assert_close(
        triton_fused.silu_mul(gate_up), reference.silu_mul(gate_up), **TOL[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hkv, d", [(4, 2, 16), (14, 2, 64), (7, 1, 32)])
def test_rotary_in_place_on_views_of_one_qkv_row(dtype, hq, hkv, d):
    t = 6
    qkv = rand(t, (hq + 2 * hkv) * d, dtype=dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hkv, d)
    positions = torch.tensor([0, 1, 7, 100, 4095, 3], dtype=torch.int32, device=DEVICE)
    inv_freq = (1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))).to(DEVICE)
    want_q, want_k = reference.rotary(q.clone(), k.clone(), positions, inv_freq)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    got_q, got_k = triton_fused.rotary(q, k, positions, inv_freq)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)  # v untouched
