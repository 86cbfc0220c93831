"""The `triton` backend's kernels against a float64 reference and the `torch` backend.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here
before the kernel modules are imported: `triton.jit` reads it when it decorates) at small
shapes; with CUDA they run compiled at full shapes (8 KV heads of 64, contexts of 4,096) with
no switch to set: `python -m pytest tests/attention/test_triton_*.py` on the GPU machine.

Every case: page sizes 1, 16 and 64; query heads per KV head 1, 4 and 7; lengths 1, a page
boundary -1/0/+1 and a long one; pages scattered and out of order in a pool of two layers (so
a layer's view is strided across pages); decode split 1 and several ways.
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Sequence

import pytest
import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)

from pdserve.attention.batch import Batch, BatchBuilder, SeqSpan  # noqa: E402
from pdserve.attention.torch_backend import TorchBackend  # noqa: E402
from pdserve.attention.triton_backend import TritonBackend  # noqa: E402
from pdserve.attention.triton_common import interpreted  # noqa: E402
from pdserve.attention.triton_decode import _decode_kernel, paged_decode  # noqa: E402
from pdserve.attention.triton_prefill import paged_prefill  # noqa: E402
from pdserve.attention.triton_store import store_kv  # noqa: E402
from pdserve.kvcache.layout import KVLayout  # noqa: E402
from pdserve.kvcache.pool import KVPool  # noqa: E402

if not GPU and not interpreted(_decode_kernel):
    pytest.skip(
        "the triton kernels were imported compiled on a machine without CUDA: set "
        "TRITON_INTERPRET=1 before anything imports pdserve.attention.triton_*",
        allow_module_level=True,
    )


def _interpreter_problem() -> str | None:
    """Why the interpreter cannot run the kernels here, if it cannot: before triton 3.8 it
    turns a loop's run-time bound into an int in a way numpy 2.4 refuses."""
    import triton
    import triton.language as tl

    @triton.jit
    def count(out_ptr, n):
        total = 0
        for _ in range(0, n):
            total += 1
        tl.store(out_ptr, total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        count[(1,)](out, 3)
    except Exception as e:  # noqa: BLE001 (any failure of the probe means: skip, with it)
        return (
            f"triton {triton.__version__}'s interpreter cannot run a loop with run-time "
            f"bounds here ({type(e).__name__}: {e}); pip install 'triton>=3.8'"
        )
    return None if out.item() == 3 else f"the interpreter counted {out.item()} to 3"


if not GPU and (problem := _interpreter_problem()):
    pytest.skip(problem, allow_module_level=True)

DEVICE = torch.device("cuda" if GPU else "cpu")
KV_HEADS = 8 if GPU else 2
HEAD_DIM = 64 if GPU else 32
LONG = 4096 if GPU else 130
SPLITS = (1, 3, 16) if GPU else (1, 3)
PAGE_SIZES = (1, 16, 64)
GROUPS = (1, 4, 7)
ALL_PAIRS = [(p, g) for p in PAGE_SIZES for g in GROUPS]
# The interpreter is slow: on the CPU the mixed batches take each page size and each group
# once (page size 1 with 7 query heads per KV head, 16 with 4, 64 with 1).
MIXED_PAIRS = ALL_PAIRS if GPU else list(zip(PAGE_SIZES, GROUPS[::-1], strict=True))
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


class Shape:
    def __init__(self, group: int) -> None:
        self.num_heads = KV_HEADS * group
        self.num_kv_heads = KV_HEADS
        self.head_dim = HEAD_DIM


def lengths(page_size: int) -> list[int]:
    """1, the page boundary -1/0/+1 (where they exist) and a long context."""
    return sorted({1, max(1, page_size - 1), page_size, page_size + 1, LONG})


class Case:
    """A randomly filled pool of two layers and sequences on scattered pages of it."""

    def __init__(self, page_size: int, group: int, dtype: torch.dtype, seed: int = 0) -> None:
        self.page_size, self.dtype = page_size, dtype
        self.shape = Shape(group)
        self.gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.rng = random.Random(seed)
        layout = KVLayout.llama(str(dtype).removeprefix("torch."), page_size, 2, KV_HEADS, HEAD_DIM)
        self.num_pages = 2 * (3 * LONG // page_size + 40)
        self.pool = KVPool(layout, self.num_pages, DEVICE)
        for i in range(2):
            for cache in self.pool.layer(i):
                cache.copy_(self.randn(*cache.shape))
        self.free = list(range(1, self.num_pages))  # page 0: the page table's padding
        self.rng.shuffle(self.free)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=DEVICE).to(self.dtype)

    def span(self, context: int, new: int) -> SeqSpan:
        pages = [self.free.pop() for _ in range(-(-(context + new) // self.page_size))]
        return SeqSpan(list(range(new)), context, pages, True)

    def batch(self, spans: Sequence[SeqSpan]) -> Batch:
        return BatchBuilder(self.page_size, self.num_pages, DEVICE).build(spans)

    def qkv(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, s = batch.num_tokens, self.shape
        return (
            self.randn(t, s.num_heads, HEAD_DIM),
            self.randn(t, KV_HEADS, HEAD_DIM),
            self.randn(t, KV_HEADS, HEAD_DIM),
        )

    def copy_pool(self) -> KVPool:
        pool = KVPool(self.pool.layout, self.num_pages, DEVICE)
        pool.data.copy_(self.pool.data)
        return pool


def reference(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [pages, page_size, Hkv, D], the step's K/V already stored
    v_cache: torch.Tensor,
    spans: Sequence[SeqSpan],
    scale: float,
) -> torch.Tensor:  # [T, Hq, D] float64
    """Each new token over its sequence's keys 0 .. its position, slot by slot, in float64."""
    ps = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out, row = [], 0
    for s in spans:
        n, kv_len = len(s.token_ids), s.start + len(s.token_ids)
        pos = torch.arange(kv_len, device=q.device)
        pages = torch.tensor(list(s.pages), device=q.device)[pos // ps]
        keys = k_cache[pages, pos % ps].double().repeat_interleave(group, 1)  # [kv, Hq, D]
        vals = v_cache[pages, pos % ps].double().repeat_interleave(group, 1)
        scores = torch.einsum("thd,khd->thk", q[row : row + n].double(), keys) * scale
        visible = pos[None, :] <= (s.start + torch.arange(n, device=q.device))[:, None]
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        out.append(torch.einsum("thk,khd->thd", probs, vals))
        row += n
    return torch.cat(out)


def run(backend: TorchBackend | TritonBackend, batch: Batch, q, k, v) -> torch.Tensor:
    meta = backend.prepare(batch)
    backend.store_kv(1, k, v, meta)
    return backend.attend(1, q, k, v, meta)


def check(case: Case, spans: list[SeqSpan], splits: Sequence[int] = SPLITS) -> None:
    """The triton backend (each split count) == float64 reference == torch backend, and
    store_kv wrote exactly what the torch backend's store wrote."""
    batch = case.batch(spans)
    q, k, v = case.qkv(batch)
    torch_pool = case.copy_pool()
    expected = run(TorchBackend(torch_pool, case.shape), batch, q, k, v)
    ref = reference(q, *torch_pool.layer(1), spans, HEAD_DIM**-0.5)
    tol = TOL[case.dtype]
    torch.testing.assert_close(expected.double(), ref, atol=tol, rtol=tol)
    for n in splits:
        pool = case.copy_pool()
        out = run(TritonBackend(pool, case.shape, num_splits=n), batch, q, k, v)
        assert out.dtype == q.dtype and out.shape == q.shape
        assert torch.equal(pool.data, torch_pool.data), "store_kv wrote other bytes"
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol, msg=f"{n} splits")
        torch.testing.assert_close(out, expected, atol=tol, rtol=tol, msg=f"{n} splits")


@pytest.mark.parametrize("page_size, group", ALL_PAIRS)
def test_decode_matches_reference(page_size: int, group: int):
    case = Case(page_size, group, torch.float32)
    # On the CPU split 3 ways only (the split kernel and its reduce); one split runs in the
    # other tests.
    check(case, [case.span(n - 1, 1) for n in lengths(page_size)], SPLITS if GPU else (3,))


@pytest.mark.parametrize("page_size, group", MIXED_PAIRS)
def test_mixed_batch_matches_reference(page_size: int, group: int):
    """Decodes, then prefill chunks: a whole prompt, chunks over cached context that start and
    end on and off page boundaries, and one-token chunks that are not decodes."""
    case = Case(page_size, group, torch.float32, seed=1)
    chunk = 96 if GPU else 21
    spans = [case.span(n - 1, 1) for n in (1, page_size + 1, LONG)]
    spans += [
        case.span(0, chunk),
        case.span(page_size, chunk),
        case.span(LONG - chunk, chunk),
        case.span(page_size + 3, page_size - 1 if page_size > 1 else 2),
        case.span(7, 1),
        case.span(0, 1),
    ]
    check(case, spans, splits=SPLITS[:2] if GPU else (1,))


@pytest.mark.parametrize("page_size", [1, 16])
def test_bfloat16_pool_and_queries(page_size: int):
    case = Case(page_size, 4, torch.bfloat16, seed=2)
    spans = [case.span(n - 1, 1) for n in lengths(page_size)] + [case.span(page_size + 5, 9)]
    check(case, spans, splits=SPLITS[:2])


def test_store_skips_negative_slots_and_converts_to_the_pool_dtype():
    case = Case(16, 1, torch.bfloat16, seed=3)
    k_cache, v_cache = case.pool.layer(0)
    before = case.pool.data.clone()
    k = torch.randn(3, KV_HEADS, HEAD_DIM, device=DEVICE)  # float32 into a bfloat16 pool
    v = torch.randn(3, KV_HEADS, HEAD_DIM, device=DEVICE)
    slots = torch.tensor([5 * 16 + 3, -1, 2 * 16], dtype=torch.int32, device=DEVICE)
    store_kv(k, v, k_cache, v_cache, slots)
    written = [(0, (5, 3)), (2, (2, 0))]
    for t, at in written:
        if GPU:  # round to nearest, as torch converts
            assert torch.equal(k_cache[at], k[t].to(torch.bfloat16))
            assert torch.equal(v_cache[at], v[t].to(torch.bfloat16))
        else:  # the interpreter truncates float32 to bfloat16: within one bfloat16 step
            torch.testing.assert_close(k_cache[at].float(), k[t], atol=1e-6, rtol=2**-7)
            torch.testing.assert_close(v_cache[at].float(), v[t], atol=1e-6, rtol=2**-7)
    expected = KVPool(case.pool.layout, case.num_pages, DEVICE)
    expected.data.copy_(before)
    ek, ev = expected.layer(0)
    for _, at in written:
        ek[at], ev[at] = k_cache[at], v_cache[at]
    assert torch.equal(case.pool.data, expected.data)  # and no other byte changed


def test_kernels_use_the_views_strides():
    """A cache whose tokens are not adjacent ([pages, Hkv, page_size, D] storage seen as
    [pages, page_size, Hkv, D]) and queries/outputs that are every other row of a wider
    tensor give the same results as contiguous ones."""
    case = Case(16, 4, torch.float32, seed=4)
    spans = [case.span(n - 1, 1) for n in lengths(16)] + [case.span(20, 13)]
    batch = case.batch(spans)
    k_flat, v_flat = (c.contiguous() for c in case.pool.layer(1))
    k_odd = k_flat.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    v_odd = v_flat.transpose(1, 2).contiguous().transpose(1, 2)
    assert k_odd.stride() != k_flat.stride()
    t, hq = batch.num_tokens, case.shape.num_heads
    wide = case.randn(t, 2 * hq, HEAD_DIM)
    q = wide[:, ::2]  # non-contiguous heads
    k_new, v_new = case.randn(t, KV_HEADS, HEAD_DIM), case.randn(t, KV_HEADS, HEAD_DIM)

    def attend(k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        store_kv(k_new, v_new, k_cache, v_cache, batch.slot_mapping)
        nd = batch.num_decodes
        paged_decode(
            q[:nd],
            k_cache,
            v_cache,
            batch.page_table[:nd],
            batch.kv_lens[:nd],
            out[:nd],
            HEAD_DIM**-0.5,
        )
        paged_prefill(
            q,
            k_cache,
            v_cache,
            batch.page_table,
            batch.kv_lens,
            batch.query_start,
            nd,
            batch.num_tokens - nd,
            out,
            HEAD_DIM**-0.5,
        )
        return out

    plain = attend(k_flat, v_flat, torch.empty(t, hq, HEAD_DIM, device=DEVICE))
    odd_out = torch.empty(t, 2 * hq, HEAD_DIM, device=DEVICE)[:, 1::2]
    odd = attend(k_odd, v_odd, odd_out)
    assert torch.equal(k_odd, k_flat) and torch.equal(v_odd, v_flat)
    torch.testing.assert_close(odd, plain, atol=1e-6, rtol=1e-6)
    ref = reference(q, k_flat, v_flat, spans, HEAD_DIM**-0.5)
    torch.testing.assert_close(plain.double(), ref, atol=2e-5, rtol=2e-5)
