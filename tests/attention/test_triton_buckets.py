"""The `triton` backend's static buckets, what CUDA graphs are captured over: a decode bucket's
buffers and a prefill bucket's (a step's decodes in its decode section, then its chunks),
filled from a step's Batch, against one eager step of the same backend, bit for bit; what a
bucket refuses; and a decode bucket captured and replayed as a graph (GPU).

Runs in Triton's CPU interpreter without a GPU (test_triton_kernels.py sets it up and holds
the cases), compiled with one."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports the kernels (see the kernel tests)
    os.environ.setdefault("TRITON_INTERPRET", "1")
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)

from pdserve.attention.triton_backend import TritonBackend  # noqa: E402
from tests.attention.test_triton_kernels import (  # noqa: E402
    DEVICE,
    GPU,
    HEAD_DIM,
    KV_HEADS,
    LONG,
    SPLITS,
    Case,
    run,
)


@pytest.mark.parametrize("splits", SPLITS)
def test_padded_bucket_rows_write_nothing_and_read_nothing(splits: int):
    """A graph bucket of 6 rows holding 3 decodes: the padded rows store nothing (slot -1),
    read no page (their table rows point far outside the pool) and come out zero; the real
    rows equal the eager result."""
    case = Case(16, 4, torch.float32, seed=5)
    spans = [case.span(n - 1, 1) for n in (1, 17, LONG)]
    batch = case.batch(spans)
    q, k, v = case.qkv(batch)
    eager_pool = case.copy_pool()
    eager = run(TritonBackend(eager_pool, case.shape, num_splits=splits), batch, q, k, v)

    backend = TritonBackend(case.pool, case.shape)
    buffers = backend.decode_buffers(6, batch.page_table.shape[1] + 2, num_splits=splits)
    buffers.page_table.fill_(2**30)  # a padded row that read its table would fault or differ
    meta = backend.prepare_decode_into(batch, buffers)
    assert buffers.kv_lens.tolist() == [1, 17, LONG, 0, 0, 0]
    assert buffers.slot_mapping.tolist()[3:] == [-1, -1, -1]
    pad = case.randn(3, *q.shape[1:])
    q6, k6, v6 = torch.cat([q, pad]), torch.cat([k, pad[:, :KV_HEADS]]), torch.cat([v, v[:3]])
    backend.store_kv(1, k6, v6, meta)
    out = backend.attend(1, q6, k6, v6, meta)
    assert torch.equal(case.pool.data, eager_pool.data)
    torch.testing.assert_close(out[:3], eager, atol=1e-6, rtol=1e-6)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))


@pytest.mark.parametrize("page_size, splits", [(1, 1), (16, 1), (16, 3)])
def test_a_mixed_step_through_a_static_bucket_equals_the_eager_step(page_size: int, splits: int):
    """A mixed step as a prefill graph runs it: three decodes in a decode section of five rows
    (so its last two rows are the first chunk's; with 3 splits the reduce kernel writes them),
    then the chunks, then padded tokens and padded sequences, in buffers that held a larger
    step before: the same bytes stored and the same outputs, bit for bit, as one eager step;
    the padding stores nothing and reads no page (its table rows point far outside the
    pool)."""
    case = Case(page_size, 4, torch.float32, seed=7)
    chunk = 40 if GPU else 13
    spans = [case.span(n - 1, 1) for n in (1, page_size + 1, LONG)]
    spans += [case.span(0, chunk), case.span(page_size + 2, chunk), case.span(5, 1)]
    batch = case.batch(spans)
    q, k, v = case.qkv(batch)
    eager_pool = case.copy_pool()
    eager = run(TritonBackend(eager_pool, case.shape, num_splits=splits), batch, q, k, v)

    backend = TritonBackend(case.pool, case.shape, num_splits=splits)
    nd, t, width = batch.num_decodes, batch.num_tokens, batch.page_table.shape[1]
    buffers = backend.prefill_buffers(t + 7, batch.num_seqs - nd + 3, width + 2, decodes=5)
    assert buffers.decode is not None and buffers.decode.num_splits == splits
    # The step before: five decodes and a longer chunk. Its lengths left behind in rows 3-4
    # would send the decode kernel through the table rows filled below.
    larger = case.batch([case.span(n, 1) for n in (3, 9, 20, 30, 40)] + [case.span(0, t - 12)])
    backend.prepare_prefill_into(larger, buffers)
    for table in (buffers.decode.page_table, buffers.page_table):
        table.fill_(2**30)  # a padded row that read its table would fault or differ
    meta = backend.prepare_prefill_into(batch, buffers)
    assert buffers.decode.kv_lens.tolist() == [1, page_size + 1, LONG, 0, 0]
    assert buffers.query_start.tolist() == [3, 3 + chunk, 3 + 2 * chunk, t, t, t, t]
    assert buffers.kv_lens.tolist() == [chunk, page_size + 2 + chunk, 6, 0, 0, 0]
    assert buffers.slot_mapping.tolist()[t:] == [-1] * 7
    assert torch.equal(buffers.slot_mapping[:t], batch.slot_mapping)
    pad = case.randn(7, *q.shape[1:])  # the bucket's padded rows: any values
    qb, kb, vb = torch.cat([q, pad]), torch.cat([k, pad[:, :KV_HEADS]]), torch.cat([v, v[:7]])
    backend.store_kv(1, kb, vb, meta)
    out = backend.attend(1, qb, kb, vb, meta)
    assert torch.equal(case.pool.data, eager_pool.data)
    assert torch.equal(out[:t], eager)


def test_a_prefill_bucket_without_a_decode_section_runs_chunks_alone():
    """Two chunks, no decodes, through a bucket with no decode section: the eager step's
    outputs bit for bit; a step with a decode has no place there and is refused."""
    case = Case(16, 4, torch.float32, seed=9)
    batch = case.batch([case.span(0, 11), case.span(17, 6)])
    q, k, v = case.qkv(batch)
    eager_pool = case.copy_pool()
    eager = run(TritonBackend(eager_pool, case.shape), batch, q, k, v)
    backend = TritonBackend(case.pool, case.shape)
    buffers = backend.prefill_buffers(32, 4, batch.page_table.shape[1])
    assert buffers.decode is None
    meta = backend.prepare_prefill_into(batch, buffers)
    assert meta.decode is None and buffers.query_start.tolist() == [0, 11, 17, 17, 17]
    pad = case.randn(32 - 17, *q.shape[1:])
    qb, kb, vb = torch.cat([q, pad]), torch.cat([k, pad[:, :KV_HEADS]]), torch.cat([v, v[:15]])
    backend.store_kv(1, kb, vb, meta)
    out = backend.attend(1, qb, kb, vb, meta)
    assert torch.equal(case.pool.data, eager_pool.data)
    assert torch.equal(out[:17], eager)
    mixed = case.batch([case.span(3, 1), case.span(0, 5)])
    room = backend.prefill_buffers(32, 4, mixed.page_table.shape[1])
    with pytest.raises(ValueError, match="1 decodes and 1 prefill chunks"):
        backend.prepare_prefill_into(mixed, room)


def test_a_prefill_bucket_refuses_what_it_cannot_hold():
    """Tokens count the step's decodes too (1 + 20 + 5 = 26)."""
    case = Case(16, 1, torch.float32, seed=8)
    batch = case.batch([case.span(3, 1), case.span(0, 20), case.span(16, 5)])
    backend = TritonBackend(case.pool, case.shape)
    width = batch.page_table.shape[1]
    for tokens, seqs, pages, decodes in (
        (25, 2, width, 1),  # one token short
        (26, 1, width, 1),  # one chunk short
        (26, 2, width - 1, 1),  # one page short
        (26, 2, width, 0),  # no room for the decode
    ):
        with pytest.raises(ValueError, match="do not fit a bucket of"):
            buffers = backend.prefill_buffers(tokens, seqs, pages, decodes)
            backend.prepare_prefill_into(batch, buffers)
    backend.prepare_prefill_into(batch, backend.prefill_buffers(26, 2, width, 1))  # just fits
    for bad in ((0, 1, 1, 0), (4, 1, 1, 5)):
        with pytest.raises(ValueError, match="needs tokens, sequences, pages"):
            backend.prefill_buffers(*bad)


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU")
def test_decode_replays_in_a_cuda_graph():
    """store_kv + attend captured once over a bucket's static buffers, replayed on new rows
    and lengths, equal the eager backend each time."""
    case = Case(16, 4, torch.bfloat16, seed=6)
    backend = TritonBackend(case.pool, case.shape)
    buffers = backend.decode_buffers(8, LONG // 16 + 2)
    q = torch.zeros(8, case.shape.num_heads, HEAD_DIM, dtype=case.dtype, device=DEVICE)
    k = torch.zeros(8, KV_HEADS, HEAD_DIM, dtype=case.dtype, device=DEVICE)
    v = torch.zeros_like(k)
    meta = backend.decode_metadata(buffers)
    backend.store_kv(1, k, v, meta)  # compile before capture (every slot is -1: no write)
    backend.attend(1, q, k, v, meta)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.store_kv(1, k, v, meta)
        out = backend.attend(1, q, k, v, meta)
    for lens in ([5, LONG, 16, 17], [1, 2, 3, 4, 5, 6, 7, 4000]):
        spans = [case.span(n - 1, 1) for n in lens]
        batch = case.batch(spans)
        nq, nk, nv = case.qkv(batch)
        eager_pool = case.copy_pool()
        eager = run(TritonBackend(eager_pool, case.shape), batch, nq, nk, nv)
        backend.prepare_decode_into(batch, buffers)
        for static, new in ((q, nq), (k, nk), (v, nv)):
            static.zero_()
            static[: len(lens)].copy_(new)
        graph.replay()
        torch.testing.assert_close(out[: len(lens)], eager, atol=2e-2, rtol=2e-2)
        assert torch.equal(case.pool.data, eager_pool.data)
        assert not out[len(lens) :].any()
