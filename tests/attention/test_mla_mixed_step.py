"""A mixed step on the `triton` backend of a latent pool (attention/mla_backend.py `split`): its
decodes attend absorbed and only its prompt chunks' sequences are gathered and expanded.

Checked: the two parts' metadata (the expanded gather's batch holds the prompt sequences alone,
its keys and mask equal those rows of the whole step's gather; the decodes' lengths and pages);
a decode-only and a prompt-only step keep the metadata they had before mixed steps were split
(CUDA-graph buckets are decode-only); and through deepseek-v3-tiny and deepseek-v32-tiny
(float32), steps of prompt chunks beside decodes equal the `torch` backend's expanded form, with
the decode rows through `attend_latent` and the gather padded to the prompts only. Runs in
Triton's CPU interpreter without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports the kernels (see the kernel tests)
    os.environ.setdefault("TRITON_INTERPRET", "1")
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)

from pdserve.attention.backend import AttentionContext  # noqa: E402
from pdserve.attention.batch import Batch, BatchBuilder, SeqSpan  # noqa: E402
from pdserve.attention.mla_backend import LatentKernel, MLABackend  # noqa: E402
from pdserve.attention.torch_backend import TorchBackend  # noqa: E402
from pdserve.kvcache.layout import LATENT, KVLayout  # noqa: E402
from pdserve.kvcache.pool import KVPool  # noqa: E402
from pdserve.model.loader import load_model  # noqa: E402

PS, PAGES = 4, 64
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = 1e-5 if DEVICE.type == "cpu" else 1e-4  # the GPU's float32 reductions run in other orders


class Shape:
    num_heads, num_kv_heads, head_dim = 2, 2, 16


def pages_for(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Scattered pages, each sequence one page more than its length needs."""
    free = list(range(1, PAGES))
    random.Random(seed).shuffle(free)
    return [[free.pop() for _ in range(-(-n // PS) + 1)] for n in lengths]


def mixed_batch(builder: BatchBuilder) -> Batch:
    """Decodes at contexts 7, 20 and 2, then a chunk of 6 over a context of 5, then a fresh
    prompt of 9: the decodes' longest row (21 keys) outruns every prompt's (11)."""
    pages = pages_for([21, 21, 3, 11, 9])
    spans = [SeqSpan([5], start, pg, True) for start, pg in zip((7, 20, 2), pages[:3], strict=True)]
    spans.append(SeqSpan(list(range(10, 16)), 5, pages[3], True))
    spans.append(SeqSpan(list(range(20, 29)), 0, pages[4], True))
    return builder.build(spans)


def latent_backends() -> tuple[MLABackend, TorchBackend]:
    layout = KVLayout.mla("float32", PS, 2, kv_lora_rank=8, qk_rope_head_dim=4)
    pool = KVPool(layout, PAGES, torch.device("cpu"))
    for i in range(2):
        view = pool.view(i, LATENT)
        view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(i)))
    return MLABackend(pool, Shape, LatentKernel.TORCH), TorchBackend(pool, Shape)


def test_a_mixed_step_gathers_only_its_prompt_sequences() -> None:
    mla, plain = latent_backends()
    batch = mixed_batch(BatchBuilder(PS, PAGES, torch.device("cpu")))
    meta = mla.prepare(batch)
    assert not mla.absorbs(meta)
    parts = mla.split(meta)
    assert parts is not None and parts.decodes == 3
    # The decodes: absorbed, their own lengths, pages narrowed to their longest row (21 keys).
    assert mla.absorbs(parts.decode) and mla.split(parts.decode) is None
    assert parts.decode.decode.kv_lens.tolist() == [8, 21, 3]
    torch.testing.assert_close(parts.decode.decode.page_table, batch.page_table[:3, :6])
    # The prompts: a gather of 2 sequences padded to 11 keys, 9 queries (not 5 x 21 x 9).
    context = mla.gather(1, LATENT, parts.rest)
    assert context.values.shape[:2] == (2, 11) and context.mask.shape == (2, 9, 11)
    assert mla.split(parts.rest) is None and not mla.absorbs(parts.rest)
    whole = plain.gather(1, LATENT, plain.prepare(batch))  # the expanded form's old gather
    assert whole.values.shape[:2] == (5, 21)
    torch.testing.assert_close(context.values, whole.values[3:, :11])
    assert torch.equal(context.mask, whole.mask[3:, :9, :11])
    x = torch.arange(batch.num_tokens - 3, dtype=torch.float32)  # the prompts' tokens only
    assert torch.equal(context.unpad(context.pad(x)), x)
    # Each part stores its own tokens; the whole step stores every token (the latents' store).
    slots = batch.slot_mapping.long()
    for m, rows in ((meta, slots), (parts.decode, slots[:3]), (parts.rest, slots[3:])):
        assert torch.equal(m.new_slots[0] * PS + m.new_slots[1], rows)
    with pytest.raises(ValueError, match="only k and v"):  # no gather of every sequence
        mla.gather(1, LATENT, meta)
    with pytest.raises(ValueError, match="split"):
        mla.attend_latent(1, torch.zeros(3, 2, 8), torch.zeros(3, 2, 4), 1.0, meta)


def test_decode_only_and_prompt_only_steps_keep_their_metadata() -> None:
    mla, _ = latent_backends()
    builder = BatchBuilder(PS, PAGES, torch.device("cpu"))
    pages = pages_for([8, 21, 3])
    decodes = builder.build(
        [SeqSpan([5], s, pg, True) for s, pg in zip((7, 20, 2), pages, strict=True)]
    )
    meta = mla.prepare(decodes)
    assert mla.split(meta) is None and meta.decode is not None
    # The Batch's own tensors, whole (what the CUDA-graph buckets and the kernels read).
    assert meta.decode.kv_lens is decodes.kv_lens and meta.decode.page_table is decodes.page_table
    assert meta.decode.num_splits == mla._splits(3, 21) and meta.causal is not None
    assert meta.num_decodes == 3
    prompts = builder.build([SeqSpan(list(range(9)), 0, pages[0], True)])
    meta = mla.prepare(prompts)
    assert mla.split(meta) is None and meta.decode is None and meta.causal is not None
    assert mla.gather(0, LATENT, meta).values.shape[:2] == (1, 9)


def spans_of_mixed_steps(prompts: list[list[int]], pages: list[list[int]]) -> list[list[SeqSpan]]:
    """A (5) whole and B (30) in part; A's decode, B's rest and C (9); the decodes of A, B and
    C (B's and C's context past V3.2's index_topk of 12 at the next) beside D (20)."""
    a, b, c, d = prompts
    pa, pb, pc, pd = pages
    return [
        [SeqSpan(a, 0, pa, True), SeqSpan(b[:14], 0, pb, False)],
        [SeqSpan([7], 5, pa, True), SeqSpan(b[14:], 14, pb, True), SeqSpan(c, 0, pc, True)],
        [
            SeqSpan([8], 6, pa, True),
            SeqSpan([9], 30, pb, True),
            SeqSpan([10], 9, pc, True),
            SeqSpan(d, 0, pd, True),
        ],
        [SeqSpan([11], 31, pb, True), SeqSpan([12], 20, pd, True)],
    ]


@pytest.mark.parametrize("kernel", [LatentKernel.TRITON, LatentKernel.TORCH])
@pytest.mark.parametrize("name", ["deepseek-v3-tiny", "deepseek-v32-tiny"])
def test_mixed_steps_equal_the_expanded_form(builtin_dir, name: str, kernel: LatentKernel):
    path: Path = builtin_dir(name)
    device = DEVICE  # the kernels compile on a GPU and run in the interpreter on the CPU
    model = load_model(path, torch.float32, device)
    arch = model.arch
    layout = KVLayout.for_model(arch, "float32", PS)
    pools = [KVPool(layout, PAGES, device) for _ in range(2)]
    mla = MLABackend(pools[1], arch, kernel)
    plain = TorchBackend(pools[0], arch)
    absorbed_rows: list[int] = []
    gathered: list[int] = []
    attend, gather = mla.attend_latent, mla.gather

    def attend_counted(layer: int, q_latent: torch.Tensor, *args: Any) -> torch.Tensor:
        absorbed_rows.append(q_latent.shape[0])
        return attend(layer, q_latent, *args)

    def gather_counted(layer: int, buffer: str, meta: Any) -> Any:
        context = gather(layer, buffer, meta)
        if buffer == LATENT:
            gathered.append(context.values.shape[0])
        return context

    mla.attend_latent = attend_counted  # type: ignore[method-assign]
    mla.gather = gather_counted  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (5, 30, 9, 20)]
    pages = pages_for([8, 33, 12, 22], seed=1)
    builder = BatchBuilder(PS, PAGES, device)
    layers = arch.num_layers
    # Per step: the decode rows attended absorbed, the sequences gathered (0: none).
    want = [(None, 2), (1, 2), (3, 1), (2, None)]
    with torch.inference_mode():
        for spans, (rows, seqs) in zip(spans_of_mixed_steps(prompts, pages), want, strict=True):
            absorbed_rows.clear()
            gathered.clear()
            batch = builder.build(spans)
            ids, positions = batch.input_ids, batch.positions
            ours = model(ids, positions, AttentionContext(mla, mla.prepare(batch)))
            ref = model(ids, positions, AttentionContext(plain, plain.prepare(batch)))
            torch.testing.assert_close(ours, ref, atol=TOL, rtol=TOL)
            assert absorbed_rows == ([] if rows is None else [rows] * layers)
            assert gathered == ([] if seqs is None else [seqs] * layers)
    for i in range(layers):
        for buffer in layout.buffers:
            ours_v, ref_v = pools[1].view(i, buffer.name), pools[0].view(i, buffer.name)
            torch.testing.assert_close(ours_v, ref_v, atol=TOL, rtol=TOL)
