"""The `triton` backend by name and inside a model: the registry, its refusals, and a tiny
model's steps (prefill chunks over cached context, then decodes) equal to the `torch` backend.

Runs in Triton's CPU interpreter without a GPU (test_triton_kernels.py sets it up), compiled
with one."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports the kernels (see the kernel tests)
    os.environ.setdefault("TRITON_INTERPRET", "1")
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)

from pdserve.attention import triton_common  # noqa: E402
from pdserve.attention.backend import AttentionContext  # noqa: E402
from pdserve.attention.batch import BatchBuilder, SeqSpan  # noqa: E402
from pdserve.attention.registry import default_backend, make_backend  # noqa: E402
from pdserve.attention.torch_backend import TorchBackend  # noqa: E402
from pdserve.attention.triton_backend import TritonBackend  # noqa: E402
from pdserve.kvcache.layout import KVLayout  # noqa: E402
from pdserve.kvcache.pool import KVPool  # noqa: E402
from pdserve.model.loader import load_model  # noqa: E402
from tests.attention.test_triton_kernels import DEVICE, GPU, Shape  # noqa: E402


def pool_for(shape: Shape, page_size: int = 16, num_pages: int = 8) -> KVPool:
    layout = KVLayout.llama("float32", page_size, 2, shape.num_kv_heads, shape.head_dim)
    return KVPool(layout, num_pages, DEVICE)


def test_triton_by_name_and_by_default_on_cuda():
    shape = Shape(4)
    assert isinstance(make_backend("triton", pool_for(shape), shape), TritonBackend)
    assert default_backend(torch.device("cpu")) == "torch"
    assert default_backend(torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="known: torch, triton"):
        make_backend("flash", pool_for(shape), shape)


@pytest.mark.skipif(GPU, reason="a CPU pool is refused only where the kernels are compiled")
def test_a_cpu_pool_is_refused_without_the_interpreter(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(triton_common, "interpreted", lambda kernel: False)
    shape = Shape(1)
    with pytest.raises(ValueError, match="runs on CUDA .* use 'torch'"):
        make_backend("triton", pool_for(shape), shape)


def test_shapes_that_do_not_fit_are_refused():
    shape = Shape(4)
    odd = Shape(4)
    odd.num_heads = 3 * odd.num_kv_heads // 2
    with pytest.raises(ValueError, match="multiple of KV heads"):
        TritonBackend(pool_for(odd), odd)
    wide = Shape(4)
    wide.head_dim *= 2
    with pytest.raises(ValueError, match=r"per token; got .* query heads and \(\d+, \d+\)"):
        TritonBackend(pool_for(shape), wide)  # the pool's heads are not the model's
    backend = TritonBackend(pool_for(shape), shape)
    with pytest.raises(ValueError, match="queries in"):
        q = torch.zeros(1, shape.num_heads, shape.head_dim, dtype=torch.float64, device=DEVICE)
        batch = BatchBuilder(16, 8, DEVICE).build([SeqSpan([1], 0, [1], True)])
        backend.attend(0, q, q[:, :4], q[:, :4], backend.prepare(batch))
    mixed = BatchBuilder(16, 8, DEVICE).build(
        [SeqSpan([1], 3, [4], True), SeqSpan([1, 2], 0, [1], True)]
    )
    buffers = backend.decode_buffers(4, 4)
    backend.prepare_decode_into(mixed, buffers)  # its decode only: the chunk is not a row
    assert buffers.kv_lens.tolist() == [4, 0, 0, 0]
    assert buffers.slot_mapping.tolist() == [4 * 16 + 3, -1, -1, -1]
    decode = BatchBuilder(16, 8, DEVICE).build([SeqSpan([1], 40, [1, 2, 3], True)])
    with pytest.raises(ValueError, match="1 decodes x 3 pages does not fit a bucket of 4 rows x 2"):
        backend.prepare_decode_into(decode, backend.decode_buffers(4, 2))


def test_tiny_model_steps_match_the_torch_backend(tiny_dir: Path):
    """Two steps of two sequences: a whole prompt and a first chunk; then a decode and the
    second chunk over its cached context. Logits of the sampling rows and the stored K/V
    agree."""
    model = load_model(tiny_dir, torch.float32, DEVICE)
    arch = model.arch
    layout = KVLayout.llama("float32", 4, arch.num_layers, arch.num_kv_heads, arch.head_dim)
    pools = [KVPool(layout, 32, DEVICE) for _ in range(2)]
    backends = [TorchBackend(pools[0], arch), TritonBackend(pools[1], arch, num_splits=2)]
    builder = BatchBuilder(4, 32, DEVICE)
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, arch.vocab_size, (21,), generator=gen).tolist()
    b = torch.randint(0, arch.vocab_size, (29,), generator=gen).tolist()
    pages_a, pages_b = [9, 3, 17, 5, 30, 1, 12], [2, 28, 7, 19, 11, 4, 25, 14, 6]
    steps = [
        [SeqSpan(a[:20], 0, pages_a, True), SeqSpan(b[:12], 0, pages_b, False)],
        [SeqSpan(a[20:21], 20, pages_a, True), SeqSpan(b[12:29], 12, pages_b, True)],
    ]
    with torch.inference_mode():
        for spans in steps:
            batch = builder.build(spans)
            logits = []
            for backend in backends:
                ctx = AttentionContext(backend, backend.prepare(batch))
                hidden = model(batch.input_ids, batch.positions, ctx)
                logits.append(model.compute_logits(hidden[batch.sample_indices]))
            torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
            assert torch.equal(logits[1].argmax(-1), logits[0].argmax(-1))
    for i in range(arch.num_layers):  # every layer's K/V stored alike
        for ours, theirs in zip(pools[1].layer(i), pools[0].layer(i), strict=True):
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
