"""The torch backend's own operations: store_kv alone, decode grouping, the registry."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.attention.backend import AttentionContext
from pdserve.attention.batch import BatchBuilder, SeqSpan
from pdserve.attention.registry import default_backend, make_backend
from pdserve.attention.torch_backend import TorchBackend, group_by_length
from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPool
from pdserve.model.config import ModelArch
from pdserve.model.llama import CausalLM

PS = 4
CPU = torch.device("cpu")


class Shape:
    num_heads = 4
    num_kv_heads = 2
    head_dim = 8


def make_pool(dtype: str = "float32", num_pages: int = 12) -> KVPool:
    return KVPool(KVLayout.llama(dtype, PS, 3, Shape.num_kv_heads, Shape.head_dim), num_pages, CPU)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_store_kv_writes_exactly_the_new_slots(dtype: str):
    pool = make_pool(dtype)
    gen = torch.Generator().manual_seed(0)
    pool.data.copy_(torch.randint(0, 256, pool.data.shape, dtype=torch.uint8, generator=gen))
    spans = [
        SeqSpan([1], 6, [5, 2], True),
        SeqSpan([1, 2, 3, 4, 5], 2, [9, 3], True),  # crosses from page 9 into page 3
    ]
    batch = BatchBuilder(PS, pool.num_pages, CPU).build(spans)
    k = torch.randn(6, Shape.num_kv_heads, Shape.head_dim, generator=gen)
    v = torch.randn(6, Shape.num_kv_heads, Shape.head_dim, generator=gen)

    expected = make_pool(dtype)
    expected.data.copy_(pool.data)
    ek, ev = expected.layer(1)
    for t, s in enumerate([2 * PS + 2, 9 * PS + 2, 9 * PS + 3, 3 * PS, 3 * PS + 1, 3 * PS + 2]):
        ek[s // PS, s % PS] = k[t].to(ek.dtype)
        ev[s // PS, s % PS] = v[t].to(ev.dtype)

    backend = TorchBackend(pool, Shape)
    backend.store_kv(1, k, v, backend.prepare(batch))
    assert torch.equal(pool.data, expected.data)  # those slots of layer 1, no other byte


def test_decode_groups_follow_group_by_length():
    pool = make_pool(num_pages=400)
    lens = [100, 150, 120, 1040, 7]
    free = iter(range(1, 400))
    spans = [SeqSpan([0], n - 1, [next(free) for _ in range(-(-n // PS))], True) for n in lens]
    batch = BatchBuilder(PS, pool.num_pages, CPU).build(spans)
    meta = TorchBackend(pool, Shape).prepare(batch)
    groups = group_by_length(lens, PS)
    assert len(groups) > 1
    assert [g.rows.tolist() for g in meta.decode_groups if g.rows is not None] == groups
    for g, rows in zip(meta.decode_groups, groups, strict=True):
        width = -(-max(lens[i] for i in rows) // PS)
        assert g.pages.tolist() == [(list(spans[i].pages) + [0] * width)[:width] for i in rows]
        assert g.mask.sum(-1).flatten().tolist() == [lens[i] for i in rows]

    one = BatchBuilder(PS, pool.num_pages, CPU).build(spans[:3])  # one group: no row index
    (only,) = TorchBackend(pool, Shape).prepare(one).decode_groups
    assert only.rows is None


def test_backends_by_name():
    pool = make_pool()
    assert default_backend(CPU) == "torch"
    assert isinstance(make_backend("torch", pool, Shape), TorchBackend)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'; known: torch"):
        make_backend("flash", pool, Shape)


class Recorder:
    """A backend that records what the model asks of it."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def prepare(self, batch: object) -> object:
        return batch

    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, metadata: object) -> None:
        self.calls.append(("store", layer, tuple(k.shape), tuple(v.shape), metadata))
        self.stored = k

    def rope_store_kv(self, layer, q, k, v, rope, metadata):
        q, k = rope.apply(q, k)
        self.store_kv(layer, k, v, metadata)
        return q, k

    def attend(self, layer, q, k, v, metadata) -> torch.Tensor:
        assert k is self.stored  # attend sees the keys that were just stored
        self.calls.append(("attend", layer, tuple(q.shape), metadata))
        return torch.zeros_like(q)


def test_the_model_stores_then_attends_through_the_backend_each_layer(tiny_dir: Path):
    arch = ModelArch.from_dir(tiny_dir)
    model = CausalLM(arch)
    rec, meta = Recorder(), object()
    t, hq, hkv, d = 3, arch.num_heads, arch.num_kv_heads, arch.head_dim
    with torch.inference_mode():
        model(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), AttentionContext(rec, meta))
    expected = []
    for i in range(arch.num_layers):
        expected.append(("store", i, (t, hkv, d), (t, hkv, d), meta))
        expected.append(("attend", i, (t, hq, d), meta))
    assert rec.calls == expected
