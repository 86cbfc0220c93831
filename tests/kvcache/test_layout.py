"""The KV layout of typed buffers: where each (layer, buffer) lives in a page, typed views that
alias the pool's bytes, refusals that name the buffer and the field, and a descriptor from a
peer that can only ever fail with ValueError."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import msgspec
import pytest
import torch

from pdserve.kvcache.layout import ALIGN, MAX_BUFFERS, BufferSpec, KVLayout
from pdserve.kvcache.pool import KVPool, pages_for_budget
from tests.kvcache.layouts import dsa, fill_random

CPU = torch.device("cpu")


# -- placement ------------------------------------------------------------------------------
def test_llama_pages_keep_the_old_byte_order():
    """K and V of every layer, layer-major: what [layers, 2, page_size, heads, head_dim] was."""
    lay = KVLayout.llama("float32", page_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
    chunk = 4 * 2 * 8 * 4
    assert lay.page_bytes == lay.bytes_per_page_all_layers == 3 * 2 * chunk
    assert [(r.layer, r.spec.name, r.offset) for r in lay.regions] == [
        (layer, name, (2 * layer + i) * chunk) for layer in range(3) for i, name in enumerate("kv")
    ]
    assert (lay.dtype, lay.torch_dtype, lay.itemsize) == ("float32", torch.float32, 4)
    assert (lay.num_kv_heads, lay.head_dim) == (2, 8)

    pool = KVPool(lay, 5, CPU)
    fill_random(pool, 0)
    old = pool.data.view(torch.float32).view(5, 3, 2, 4, 2, 8)  # the pool as it used to be
    for layer in range(3):
        k, v = pool.layer(layer)
        assert k.shape == v.shape == (5, 4, 2, 8) and k.dtype == torch.float32
        assert k.data_ptr() == old[:, layer, 0].data_ptr() and k.stride() == old[:, 0, 0].stride()
        assert torch.equal(k.view(torch.int32), old[:, layer, 0].view(torch.int32))
        assert torch.equal(v.view(torch.int32), old[:, layer, 1].view(torch.int32))


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
def test_regions_are_aligned_disjoint_and_inside_the_page(page_size):
    lay = dsa(page_size=page_size, num_layers=5)
    assert lay.page_bytes % ALIGN == 0
    assert [(r.layer, r.spec.name) for r in lay.regions] == [
        (0, "latent"),
        (0, "index_k"),
        (0, "index_k_scale"),
        (1, "latent"),
        (2, "latent"),
        (2, "index_k"),
        (2, "index_k_scale"),
        (3, "latent"),
        (4, "latent"),
        (4, "index_k"),
        (4, "index_k_scale"),
    ]
    end = 0
    for r in lay.regions:
        assert r.offset % ALIGN == 0 and r.offset >= end
        assert (
            r.nbytes
            == page_size * {"latent": 1152, "index_k": 128, "index_k_scale": 4}[r.spec.name]
        )
        end = r.offset + r.nbytes
    assert end <= lay.page_bytes < end + ALIGN
    assert lay.region(2, "index_k_scale").spec.dtype == "float32"
    with pytest.raises(KeyError, match="layer 1 .* 'index_k'"):
        lay.region(1, "index_k")
    assert lay.layers_of("latent") == (0, 1, 2, 3, 4) and lay.layers_of("index_k") == (0, 2, 4)


def test_fields_of_one_dtype_and_shape_are_refused_for_a_mixed_layout():
    lay = dsa()
    with pytest.raises(ValueError, match="several dtypes"):
        _ = lay.dtype
    with pytest.raises(KeyError, match="'k'"):
        _ = lay.num_kv_heads


# -- typed views ----------------------------------------------------------------------------
def views(pool: KVPool) -> list[tuple[int, str, torch.Tensor]]:
    return [(r.layer, r.spec.name, pool.view(r.layer, r.spec.name)) for r in pool.layout.regions]


@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_typed_views_alias_the_bytes_and_do_not_overlap(page_size):
    lay = dsa(page_size=page_size)
    pool = KVPool(lay, 4, CPU)
    fill_random(pool, page_size)
    dtypes = {
        "latent": torch.bfloat16,
        "index_k": torch.float8_e4m3fn,
        "index_k_scale": torch.float32,
    }
    shapes = {"latent": (1, 576), "index_k": (1, 128), "index_k_scale": (1,)}
    for i, (layer, name, view) in enumerate(views(pool)):
        r = lay.region(layer, name)
        assert view.dtype == dtypes[name] and view.shape == (4, page_size, *shapes[name])
        assert view.data_ptr() == pool.data.data_ptr() + r.offset
        assert view.data_ptr() % ALIGN == 0
        before = pool.data.clone()
        pattern = torch.full(view.shape, float(i + 1)).to(view.dtype)
        view.copy_(pattern)  # writes through the view land in the pool's bytes ...
        inside = torch.zeros(lay.page_bytes, dtype=torch.bool)
        inside[r.offset : r.offset + r.nbytes] = True
        assert torch.equal(pool.data[:, ~inside], before[:, ~inside]), f"{name}@{layer} spilled"
        want = pattern.view(torch.uint8).reshape(4, r.nbytes)
        assert torch.equal(pool.data[:, inside], want)
        for p in range(4):  # ... and bytes written into a page show through the view
            pool.page(p)[r.offset : r.offset + r.nbytes] = 0xA0 + p
            assert bool((view[p].view(torch.uint8) == 0xA0 + p).all())
    with pytest.raises(KeyError):
        pool.view(1, "index_k")  # layer 1 has no indexer


def test_views_of_each_region_hold_their_own_pattern():
    """Each view filled with its own value, then all read back: none overwrote another."""
    pool = KVPool(dsa(), 3, CPU)
    all_views = views(pool)
    for i, (_, _, view) in enumerate(all_views):
        view.fill_(i + 1)
    for i, (layer, name, view) in enumerate(all_views):
        assert torch.equal(view.float(), torch.full(view.shape, float(i + 1))), (layer, name)
    padding = torch.ones(pool.layout.page_bytes, dtype=torch.bool)
    for r in pool.layout.regions:
        padding[r.offset : r.offset + r.nbytes] = False
    assert padding.any() and not pool.data[:, padding].any()  # and none wrote outside its own


def test_a_llama_layer_is_k_and_v_only():
    pool = KVPool(dsa(), 2, CPU)
    with pytest.raises(KeyError, match="'k'"):
        pool.layer(0)


def test_budget_counts_whole_pages():
    lay = dsa()
    assert pages_for_budget(lay, 10 * lay.page_bytes + lay.page_bytes - 1) == 10


# -- compatibility --------------------------------------------------------------------------
def with_buffer(lay: KVLayout, which: str, **changes: object) -> KVLayout:
    bufs = tuple(replace(b, **changes) if b.name == which else b for b in lay.buffers)
    return replace(lay, buffers=bufs)


def test_equal_layouts_match():
    assert dsa().mismatch(dsa()) is None
    assert dsa().mismatch(replace(dsa(), tp_rank=0)) is None
    lay = KVLayout.llama("bfloat16", 16, 4, 2, 64, tp_rank=1, tp_size=2)
    assert lay.mismatch(replace(lay, tp_rank=0)) is None  # ranks pair across, sizes must agree
    # "every layer" spelled out is the same placement as None
    spelled = with_buffer(lay, "k", layers=(0, 1, 2, 3))
    assert lay.mismatch(spelled) is None and spelled.mismatch(lay) is None


@pytest.mark.parametrize(
    "theirs,expected",
    [
        (with_buffer(dsa(), "index_k", dtype="bfloat16"),
         "buffer 'index_k' dtype: 'float8_e4m3fn' vs 'bfloat16'"),
        (with_buffer(dsa(), "latent", shape=(1, 512)),
         "buffer 'latent' shape: (1, 576) vs (1, 512)"),
        (with_buffer(dsa(), "index_k_scale", layers=(0,)),
         "buffer 'index_k_scale' layers: (0, 2) vs (0,)"),
        (with_buffer(dsa(), "index_k", layers=None), "buffer 'index_k' layers: (0, 2) vs all"),
        (with_buffer(dsa(), "index_k", name="index_q"), "buffer 'index_k' missing on decode"),
        (replace(dsa(), buffers=dsa().buffers[:2]), "buffer 'index_k_scale' missing on decode"),
        (replace(dsa(), buffers=(*dsa().buffers, BufferSpec("extra", (8,), "int8"))),
         "buffer 'extra' missing on prefill"),
        (replace(dsa(), buffers=dsa().buffers[::-1]),
         "buffer order: ['latent', 'index_k', 'index_k_scale'] vs "
         "['index_k_scale', 'index_k', 'latent']"),
        (dsa(page_size=8), "page_size: 4 vs 8"),
        (dsa(num_layers=4), "num_layers: 3 vs 4"),
        (replace(dsa(), tp_size=2), "tp_size: 1 vs 2"),
    ],
)  # fmt: skip
def test_a_mismatch_names_the_buffer_and_the_field(theirs, expected):
    assert dsa().mismatch(theirs, ours="prefill", theirs="decode") == expected


def test_llama_mismatch_names_the_field():
    a = KVLayout.llama("float32", 16, 4, 4, 32)
    assert a.mismatch(KVLayout.llama("float32", 16, 4, 4, 32)) is None
    assert a.mismatch(KVLayout.llama("bfloat16", 16, 4, 4, 32)) == (
        "buffer 'k' dtype: 'float32' vs 'bfloat16'"
    )
    assert a.mismatch(KVLayout.llama("float32", 8, 4, 4, 32)).startswith("page_size")
    assert a.mismatch(KVLayout.llama("float32", 16, 4, 4, 64)) == (
        "buffer 'k' shape: (4, 32) vs (4, 64)"
    )


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: KVLayout.llama("floaty", 16, 4, 4, 32), "dtype 'floaty' is not one of"),
        (lambda: KVLayout.llama("float32", 0, 4, 4, 32), "page_size"),
        (lambda: KVLayout.llama("float32", 16, 4, 0, 32), "shape"),
        (lambda: KVLayout.llama("float32", 16, 4, 4, 32, tp_rank=1), "tp_rank"),
        (lambda: with_buffer(dsa(), "index_k", layers=(0, 3)), "names layer 3"),
        (lambda: with_buffer(dsa(), "index_k", layers=(2, 0)), "strictly increasing"),
        (lambda: with_buffer(dsa(), "index_k", layers=()), "1 to"),
        (lambda: with_buffer(dsa(), "index_k", name="latent"), "duplicate"),
        (lambda: with_buffer(dsa(), "index_k", name="a/b"), "letters"),
        (lambda: replace(dsa(), buffers=()), "1 to"),
        (lambda: BufferSpec("k", (2, 8), "float32", layers=[0, 1]), "tuple"),  # type: ignore[arg-type]
    ],
)
def test_invalid_layouts_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# -- the descriptor a peer sends ------------------------------------------------------------
@pytest.mark.parametrize(
    "lay", [dsa(), KVLayout.llama("bfloat16", 16, 24, 2, 64, tp_rank=3, tp_size=4)]
)
def test_descriptor_round_trips_through_every_codec(lay):
    d = lay.to_dict()
    assert KVLayout.from_dict(d) == lay
    assert KVLayout.from_dict(json.loads(json.dumps(d))) == lay  # /info
    assert KVLayout.from_dict(msgspec.msgpack.decode(msgspec.msgpack.encode(d))) == lay
    back = KVLayout.from_dict(d)
    assert [(r.layer, r.spec, r.offset, r.nbytes) for r in back.regions] == [
        (r.layer, r.spec, r.offset, r.nbytes) for r in lay.regions
    ]


def hostile_cases() -> list[object]:
    valid = dsa().to_dict()
    buf = valid["buffers"][1]  # type: ignore[index]
    return [
        None,
        [],
        "buffers",
        {},
        {"dtype": "float64"},  # the old descriptor's field
        {**valid, "regions": []},
        {**valid, "page_bytes": 64},
        {**valid, "buffers": None},
        {**valid, "buffers": {}},
        {**valid, "buffers": [buf] * (MAX_BUFFERS + 1)},
        {**valid, "buffers": [{**buf, "name": f"b{i}"} for i in range(MAX_BUFFERS + 1)]},
        {**valid, "page_size": 10**30},
        {**valid, "page_size": 10**5000},  # past what str() of an int may print
        {**valid, "page_size": -1},
        {**valid, "page_size": True},
        {**valid, "page_size": 4.0},
        {**valid, "num_layers": 10**30},
        {**valid, "tp_size": 0},
        {**valid, "tp_rank": -1},
        {**valid, "buffers": [{**buf, "shape": [1, 10**30]}]},
        {**valid, "buffers": [{**buf, "shape": [1] * 10_000}]},
        {**valid, "buffers": [{**buf, "shape": [-1, 128]}]},
        {**valid, "buffers": [{**buf, "shape": [1, -(10**5000)]}]},
        {**valid, "buffers": [{**buf, "shape": [[1], 128]}]},
        {**valid, "buffers": [{**buf, "shape": []}]},
        {**valid, "buffers": [{**buf, "layers": list(range(10**5))}]},
        {**valid, "buffers": [{**buf, "layers": [0, 10**30]}]},
        {**valid, "buffers": [{**buf, "dtype": "float8_e4m3fnuz_oops"}]},
        {**valid, "buffers": [{**buf, "dtype": "__class__"}]},
        {**valid, "buffers": [{**buf, "dtype": ["bfloat16"]}]},
        {**valid, "buffers": [{**buf, "name": None}]},
        {**valid, "buffers": [{**buf, "name": "x" * 10_000}]},
        {**valid, "buffers": [{**buf, "unknown": 1}]},
        {**valid, "buffers": [{1: "k"}]},
        # each dimension within bounds, the page past any: 4M bytes a token in 1024 layers
        {**valid, "num_layers": 1024, "buffers": [{**buf, "shape": [1 << 20, 4], "layers": None}]},
    ]


@pytest.mark.parametrize("d", hostile_cases())
def test_hostile_descriptors_raise_value_error(d):
    with pytest.raises(ValueError, match="^KVLayout"):
        KVLayout.from_dict(d)  # type: ignore[arg-type]


JUNK: list[object] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    3,
    10**30,
    -(10**30),
    2**63,
    1.5,
    float("nan"),
    "",
    "k",
    "bfloat16",
    "float8_e4m3fn",
    "x" * 300,
    b"\x00",
    [],
    [1],
    [[1]],
    [None],
    [10**30],
    {},
    {"name": "k"},
]
KEYS = ["buffers", "page_size", "num_layers", "tp_rank", "tp_size", "dtype", "name", "shape"]
BUF_KEYS = ["name", "shape", "dtype", "layers", "offset"]


def junk(rng: random.Random, depth: int = 0) -> object:
    roll = rng.random()
    if depth < 3 and roll < 0.15:
        return [junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    if depth < 3 and roll < 0.25:
        return {rng.choice(BUF_KEYS + KEYS): junk(rng, depth + 1) for _ in range(rng.randrange(4))}
    return rng.choice(JUNK)


def mutate(rng: random.Random, d: dict[str, object]) -> object:
    """A valid descriptor with a few fields replaced, dropped or added, at either level."""
    d = json.loads(json.dumps(d))
    for _ in range(rng.randrange(1, 4)):
        bufs = d.get("buffers")
        target: dict[str, object] = d
        keys = KEYS
        if isinstance(bufs, list) and bufs and isinstance(bufs[0], dict) and rng.random() < 0.6:
            target = rng.choice(bufs)
            keys = BUF_KEYS
        key = rng.choice(keys)
        if rng.random() < 0.2:
            target.pop(key, None)
        else:
            target[key] = junk(rng)
    return d


def test_fuzzed_descriptors_raise_value_error_only():
    rng = random.Random(1234)
    valid = [dsa().to_dict(), KVLayout.llama("float16", 16, 4, 2, 8).to_dict()]
    accepted = 0
    for i in range(3000):
        if i % 3 == 0:
            d: object = {rng.choice(KEYS): junk(rng) for _ in range(rng.randrange(6))}
        else:
            d = mutate(rng, rng.choice(valid))
        try:
            lay = KVLayout.from_dict(d)  # type: ignore[arg-type]
        except ValueError:
            continue
        accepted += 1  # a junk value that happens to be valid: then it must be a whole layout
        assert KVLayout.from_dict(lay.to_dict()) == lay
        assert lay.page_bytes % ALIGN == 0
    assert accepted < 3000 // 4
