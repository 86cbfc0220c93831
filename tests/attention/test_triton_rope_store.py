"""The `triton` backend's fused RoPE + KV store (`rope_store_kv`) against rotary then
store_kv (bit for bit) and the `torch` backend's pair of ops (to rounding), on the pools and
cases of tests/attention/test_triton_kernels.py (its interpreter setup and skips apply here).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.backend import Rope
from pdserve.attention.torch_backend import TorchBackend
from pdserve.attention.triton_backend import TritonBackend
from pdserve.kernels import triton_fused
from tests.attention.test_triton_kernels import (
    DEVICE,
    HEAD_DIM,
    KV_HEADS,
    PAGE_SIZES,
    Case,
)


def fused_qkv_views(q, k, v):
    """q, k, v as views of one [T, (Hq + 2 Hkv) D] row each, as the model's qkv_proj makes."""
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    sizes = [q[0].numel(), k[0].numel(), v[0].numel()]
    a, b, c = qkv.split(sizes, dim=1)
    return a.view(q.shape), b.view(k.shape), c.view(v.shape), qkv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_rope_store_kv_is_rotary_then_store_kv(dtype: torch.dtype, page_size: int):
    """The fused kernel leaves q, k and the pool bit for bit as rotary then store_kv did, on
    views of a fused qkv row, and as the torch backend's pair of ops to rounding."""
    case = Case(page_size, 4, dtype, seed=7)
    batch = case.batch([case.span(0, 5), case.span(page_size - 1, 1), case.span(30, 2)])
    q, k, v = case.qkv(batch)
    rope = Rope(
        torch.tensor([0, 1, 2, 3, 4, page_size - 1, 30, 4095][: batch.num_tokens], device=DEVICE),
        1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, device=DEVICE).float() / HEAD_DIM)),
    )
    pools, outs = [], []
    for fused in (True, False):
        pool = case.copy_pool()
        backend = TritonBackend(pool, case.shape)
        qf, kf, vf, _ = fused_qkv_views(q, k, v)
        meta = backend.prepare(batch)
        if fused:
            got = backend.rope_store_kv(1, qf, kf, vf, rope, meta)
        else:
            got = triton_fused.rotary(qf, kf, rope.positions, rope.inv_freq)
            backend.store_kv(1, got[1], vf, meta)
        assert got[0].data_ptr() == qf.data_ptr() and got[1].data_ptr() == kf.data_ptr()
        pools.append(pool)
        outs.append(got)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.equal(pools[0].data, pools[1].data)
    torch_pool = case.copy_pool()
    torch_backend = TorchBackend(torch_pool, case.shape)
    tq, tk = torch_backend.rope_store_kv(1, q, k, v, rope, torch_backend.prepare(batch))
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs[0][0], tq, **tol)
    for got_cache, want_cache in zip(pools[0].layer(1), torch_pool.layer(1), strict=True):
        torch.testing.assert_close(got_cache, want_cache, **tol)


def test_rope_store_kv_skips_padded_rows():
    """Slot -1 (a graph bucket's padding): the row is rotated but nothing reaches the pool."""
    case = Case(16, 4, torch.float32, seed=8)
    batch = case.batch([case.span(3, 1), case.span(40, 1)])
    backend = TritonBackend(case.pool, case.shape)
    buffers = backend.decode_buffers(4, batch.page_table.shape[1] + 1, num_splits=1)
    meta = backend.prepare_decode_into(batch, buffers)
    before = case.copy_pool()
    q, k, v = (
        case.randn(4, *s)
        for s in [(case.shape.num_heads, HEAD_DIM), (KV_HEADS, HEAD_DIM), (KV_HEADS, HEAD_DIM)]
    )
    rope = Rope(
        torch.tensor([3, 40, 0, 0], device=DEVICE), torch.ones(HEAD_DIM // 2, device=DEVICE)
    )
    backend.rope_store_kv(1, q, k, v, rope, meta)
    written = (case.pool.data != before.data).sum().item()
    assert written > 0  # the two real rows were stored
    expected = case.copy_pool()
    expected.data.copy_(before.data)
    TritonBackend(expected, case.shape).store_kv(1, k[:2], v[:2], backend.prepare(batch))
    assert torch.equal(case.pool.data, expected.data)
