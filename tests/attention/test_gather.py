"""The generic pair of the torch backend (`store`, `gather`) over a latent-attention layout:
store writes exactly the new tokens' slots of one named buffer; gather returns each sequence's
cached context plus this step's tokens, in token order, with the causal mask of its positions;
pad and unpad are inverses."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.backend import CausalContext, GatherBackend
from pdserve.attention.batch import BatchBuilder, SeqSpan
from pdserve.attention.torch_backend import TorchBackend
from pdserve.kvcache.layout import KVLayout, index_k_buffers
from pdserve.kvcache.pool import KVPool

PS, LAYERS, WIDTH = 4, 2, 6
CPU = torch.device("cpu")


class Shape:  # the torch backend reads these; a latent layout has no k/v to check them against
    num_heads = 2
    num_kv_heads = 2
    head_dim = 8


def pool_with_noise(dtype: str) -> KVPool:
    pool = KVPool(KVLayout.mla(dtype, PS, LAYERS, kv_lora_rank=4, qk_rope_head_dim=2), 16, CPU)
    gen = torch.Generator().manual_seed(0)
    pool.data.copy_(torch.randint(0, 256, pool.data.shape, dtype=torch.uint8, generator=gen))
    return pool


# A decode with 6 cached tokens, a chunk of 5 after 2 cached (pages 9 then 3), a fresh prompt.
SPANS = [
    SeqSpan([1], 6, [5, 2], True),
    SeqSpan([1, 2, 3, 4, 5], 2, [9, 3], True),
    SeqSpan([7, 8, 9], 0, [11], True),
]


def slots(span: SeqSpan) -> list[int]:
    """Pool slots of the span's tokens 0 .. start + new - 1, in token order."""
    return [span.pages[p // PS] * PS + p % PS for p in range(span.start + len(span.token_ids))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_store_writes_the_new_slots_and_gather_returns_each_whole_context(dtype: str) -> None:
    pool = pool_with_noise(dtype)
    backend = TorchBackend(pool, Shape)
    assert isinstance(backend, GatherBackend) and backend.kv == []
    batch = BatchBuilder(PS, pool.num_pages, CPU).build(SPANS)
    meta = backend.prepare(batch)
    new = torch.randn(batch.num_tokens, 1, WIDTH, generator=torch.Generator().manual_seed(1))

    before = pool.data.clone()
    backend.store(1, "latent", new, meta)
    view = pool.view(1, "latent")
    new_slots = [s for sp in SPANS for s in slots(sp)[sp.start :]]
    for t, s in enumerate(new_slots):
        assert torch.equal(view[s // PS, s % PS], new[t].to(view.dtype))
        view[s // PS, s % PS] = pool_view_of(before, pool)[s // PS, s % PS]
    assert torch.equal(pool.data, before)  # nothing but those slots of layer 1 changed
    backend.store(1, "latent", new, meta)

    ctx = backend.gather(1, "latent", meta)
    assert isinstance(ctx, CausalContext)
    assert ctx.values.shape == (3, 7, 1, WIDTH) and ctx.mask.shape == (3, 5, 7)
    for b, sp in enumerate(SPANS):
        want = torch.stack([view[s // PS, s % PS] for s in slots(sp)])
        assert torch.equal(ctx.values[b, : len(want)], want)
        for q in range(5):
            pos = sp.start + q if q < len(sp.token_ids) else -1  # -1: a padding slot
            assert ctx.mask[b, q].tolist() == [k <= pos for k in range(7)]
    assert torch.equal(ctx.unpad(ctx.pad(new)), new)
    assert ctx.pad(new)[1, :5].equal(new[1:6]) and ctx.pad(new)[0, 1:].eq(0).all()


def pool_view_of(data: torch.Tensor, pool: KVPool) -> torch.Tensor:
    """Layer 1's latent buffer as a view over another copy of the pool's bytes."""
    r = pool.layout.region(1, "latent")
    raw = data[:, r.offset : r.offset + r.nbytes]
    return raw.view(r.spec.torch_dtype).view(pool.num_pages, PS, *r.spec.shape)


def test_gather_refuses_a_layout_of_only_k_and_v() -> None:
    pool = KVPool(KVLayout.llama("float32", PS, 1, 2, 8), 4, CPU)
    backend = TorchBackend(pool, Shape)
    meta = backend.prepare(BatchBuilder(PS, 4, CPU).build([SeqSpan([1, 2], 0, [0], True)]))
    assert meta.causal is None
    with pytest.raises(ValueError, match="only k and v"):
        backend.gather(0, "k", meta)


def test_the_layout_follows_the_model() -> None:
    class Latent:
        kv_lora_rank, qk_rope_head_dim = 512, 64

    class Indexer:  # DeepSeek-V3.2's
        index_head_dim = 128

    class Arch:
        num_layers, num_kv_heads, head_dim = 61, 128, 192
        mla: Latent | None = Latent()
        dsa: Indexer | None = None
        v4 = None

    layout = KVLayout.for_model(Arch(), "bfloat16", 64)
    assert [(b.name, b.shape, b.dtype) for b in layout.buffers] == [
        ("latent", (1, 576), "bfloat16")
    ]
    assert layout.page_bytes == 61 * 64 * 576 * 2
    Arch.dsa = Indexer()
    latent = ("latent", (1, 576), "bfloat16")
    for mode, index in [
        ("auto", [("index_k", (128,), "bfloat16")]),
        ("fp8", [("index_k", (128,), "float8_e4m3fn"), ("index_k_scale", (1,), "float32")]),
    ]:
        layout = KVLayout.for_model(Arch(), "bfloat16", 64, mode)
        assert [(b.name, b.shape, b.dtype) for b in layout.buffers] == [latent, *index]
    assert layout.page_bytes == 61 * 64 * (576 * 2 + 128 + 4)  # every region 64-byte aligned
    Arch.mla = None
    assert KVLayout.for_model(Arch(), "float16", 16) == KVLayout.llama("float16", 16, 61, 128, 192)


def test_a_latent_layout_travels_by_descriptor_and_a_mismatch_is_named() -> None:
    ours = KVLayout.mla("bfloat16", 16, 4, kv_lora_rank=512, qk_rope_head_dim=64)
    assert KVLayout.from_dict(ours.to_dict()) == ours
    theirs = KVLayout.mla("bfloat16", 16, 4, kv_lora_rank=512, qk_rope_head_dim=32)
    assert ours.mismatch(theirs) == "buffer 'latent' shape: (1, 576) vs (1, 544)"
    assert (
        ours.mismatch(KVLayout.llama("bfloat16", 16, 4, 1, 576))
        == "buffer 'latent' missing on theirs"
    )


def test_store_refuses_to_cast_floats_into_an_fp8_buffer() -> None:
    """fp8 needs a scale, which only the model computes: a plain cast would store garbage."""
    latent = KVLayout.mla("float32", PS, LAYERS, 4, 2).buffers
    layout = KVLayout(latent + index_k_buffers("fp8", 8, "float32"), PS, LAYERS)
    pool = KVPool(layout, 16, CPU)
    backend = TorchBackend(pool, Shape)
    meta = backend.prepare(BatchBuilder(PS, pool.num_pages, CPU).build(SPANS))
    assert backend.buffer_dtype(1, "index_k") == torch.float8_e4m3fn
    assert backend.buffer_dtype(1, "latent") == torch.float32
    keys = torch.randn(9, 8)
    with pytest.raises(ValueError, match="float32 values into .*'index_k'.*quantise them first"):
        backend.store(1, "index_k", keys, meta)
    backend.store(1, "index_k", keys.to(torch.float8_e4m3fn), meta)
    backend.store(1, "index_k_scale", torch.ones(9, 1), meta)  # float32 into float32: fine
