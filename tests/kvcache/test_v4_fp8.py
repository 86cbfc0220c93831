"""DeepSeek-V4's fp8 KV layout (`--kv-dtype fp8`, kvcache/v4_layout.py): its components, the
handshake naming the component and both dtypes against a peer of the other mode, other models
refused, the pool's seam (`buffer_dtype`, no float cast into fp8, the model's quantised rows
landing in the pages as stored locally), and the flag from `serve`/`launch` to the layout."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from pdserve import config
from pdserve.attention.batch import BatchBuilder, Decodes, SeqSpan
from pdserve.attention.v4_kv import PoolStepKV
from pdserve.config import CacheConfig
from pdserve.kvcache import v4_layout
from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPool
from pdserve.kvcache.v4_layout import (
    CSA,
    CSA_INDEX_K,
    CSA_KV,
    HCA,
    HCA_KV,
    SWA,
    rope_of,
    scale_of,
    v4_buffers,
    v4_page_size,
    v4_state,
)
from pdserve.model.deepseek_v4 import kv_quant
from pdserve.model.deepseek_v4.kv import LocalSeqKV
from pdserve.model.deepseek_v4.kv_quant import Fp8Form


@dataclass(frozen=True)
class Rope:
    dim: int = 64


@dataclass(frozen=True)
class Shape:
    num_layers: int = 4
    layer_types: tuple[str, ...] = (SWA, CSA, HCA, CSA)
    head_dim: int = 512
    index_head_dim: int = 128
    sliding_window: int = 16
    csa_ratio: int = 4
    hca_ratio: int = 128
    compress_rope: Rope = field(default_factory=Rope)


def layout(kv_dtype: str, dtype: str = "bfloat16", shape: Shape | None = None) -> KVLayout:
    s = shape or Shape()
    return KVLayout(
        v4_buffers(s, dtype, 128, kv_dtype),
        v4_page_size(s, 128),
        s.num_layers,
        state=v4_state(s, dtype),
    )


def test_fp8_components_their_dtypes_and_sizes() -> None:
    lay = layout("fp8")
    got = {
        b.name: (b.shape, b.dtype, b.layers, b.tokens_per_row)
        for b in lay.buffers
        if ".page_" not in b.name  # each page's end: the model dtype in both modes
    }
    assert got == {
        CSA_KV: ((448,), "float8_e4m3fn", (1, 3), 4),  # 512 - 64 rotary channels
        "csa.kv_scale": ((7,), "float32", (1, 3), 4),  # one a 64-channel block
        "csa.kv_rope": ((64,), "bfloat16", (1, 3), 4),
        CSA_INDEX_K: ((128,), "float8_e4m3fn", (1, 3), 4),
        "csa.index_k_scale": ((1,), "float32", (1, 3), 4),  # one a row
        HCA_KV: ((448,), "float8_e4m3fn", (2,), 128),
        "hca.kv_scale": ((7,), "float32", (2,), 128),
        "hca.kv_rope": ((64,), "bfloat16", (2,), 128),
    }
    assert lay.state == layout("auto").state  # the per-request state: the model dtype
    ends = [b for b in lay.buffers if ".page_" in b.name]
    assert ends == [b for b in layout("auto").buffers if ".page_" in b.name]
    # 604 bytes an entry, not 1024; an indexer key 132, not 256.
    csa = sum(b.token_bytes for b in lay.buffers if b.name.startswith("csa.kv"))
    assert csa == 604 and layout("auto").buffer(CSA_KV).token_bytes == 1024
    assert KVLayout.from_desc(lay.to_desc()) == lay  # it travels like any layout
    # The rotary part in the model dtype (float32 for the parity tests); a last short block.
    odd = layout("fp8", "float32", Shape(head_dim=200))
    assert odd.buffer(rope_of(CSA_KV)).dtype == "float32"
    assert odd.buffer(CSA_KV).shape == (136,) and odd.buffer(scale_of(CSA_KV)).shape == (3,)


def test_fp8_is_refused_where_it_cannot_be() -> None:
    with pytest.raises(ValueError, match="all 64 of a head rotate"):
        layout("fp8", shape=Shape(head_dim=64))
    with pytest.raises(ValueError, match=r"KV dtype must be one of \('auto', 'fp8'\)"):
        layout("fp4")
    base = dict(num_layers=2, num_kv_heads=1, head_dim=8, v4=None, dsa=None)
    llama = SimpleNamespace(**base, mla=None)
    mla = SimpleNamespace(**base, mla=SimpleNamespace(kv_lora_rank=8, qk_rope_head_dim=4))
    v32 = SimpleNamespace(**{**vars(mla), "dsa": SimpleNamespace(index_head_dim=8)})
    with pytest.raises(ValueError, match=r"DeepSeek-V4 only: this model's k and v stays"):
        KVLayout.for_model(llama, "bfloat16", 16, kv="fp8")
    with pytest.raises(ValueError, match=r"MLA's latent stays in the model dtype") as e:
        KVLayout.for_model(mla, "bfloat16", 16, kv="fp8")
    assert "index-k-dtype" not in str(e.value)
    with pytest.raises(ValueError, match=r"for fp8 indexer keys, --index-k-dtype fp8"):
        KVLayout.for_model(v32, "bfloat16", 16, kv="fp8")
    assert KVLayout.for_model(llama, "bfloat16", 16).buffer("k").dtype == "bfloat16"
    assert KVLayout.for_model(SimpleNamespace(**{**base, "v4": Shape()}), "bfloat16", 16, kv="fp8")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_handshake_names_the_component_and_both_dtypes(dtype: str) -> None:
    auto, fp8 = layout("auto", dtype), layout("fp8", dtype)
    want = f"buffer 'csa.kv' dtype: '{dtype}' vs 'float8_e4m3fn'"
    assert auto.mismatch(fp8) == want
    assert fp8.mismatch(auto) == f"buffer 'csa.kv' dtype: 'float8_e4m3fn' vs '{dtype}'"
    hca_only = Shape(num_layers=2, layer_types=(SWA, HCA))
    assert layout("auto", dtype, hca_only).mismatch(layout("fp8", dtype, hca_only)) == (
        f"buffer 'hca.kv' dtype: '{dtype}' vs 'float8_e4m3fn'"
    )
    assert fp8.mismatch(layout("fp8", dtype)) is None


def test_the_pool_seam_reports_dtypes_refuses_casts_and_holds_what_local_holds() -> None:
    shape = Shape(head_dim=96, index_head_dim=32, compress_rope=Rope(32))
    lay = layout("fp8", "float32", shape)
    pool = KVPool(lay, 4, torch.device("cpu"), state_slots=1)
    batch = BatchBuilder(lay.page_size, pool.num_pages, pool.device).build_step(
        Decodes([], [], [], [], []),
        [SeqSpan(list(range(300)), 0, [3, 0, 2], True)],
        state_slots=[0],
    )
    pooled = PoolStepKV(pool, batch, []).seq(1, 0)
    local = LocalSeqKV({b.name: b for b in lay.buffers}, {s.name: s for s in lay.state}).view(1)
    for seq in (pooled, local):
        assert seq.buffer_dtype(CSA_KV) == torch.float8_e4m3fn
        assert seq.buffer_dtype(rope_of(CSA_KV)) == torch.float32
        assert seq.buffer_dtype(HCA_KV) is None  # layer 1 is a CSA layer
        assert seq.buffer_dtype("nothing") is None
        with pytest.raises(ValueError, match="quantise them first"):
            seq.store_rows(CSA_KV, 0, torch.zeros(1, 64))
    form = Fp8Form(32, 64)  # 64 quantised channels in one block, 32 rotary ones kept
    values = torch.randn(75, 96, generator=torch.Generator().manual_seed(3))
    for first, n in ((0, 40), (40, 35)):  # entries 32.. on the second page
        for seq in (pooled, local):
            kv_quant.store_rows(seq, CSA_KV, first, values[first : first + n], form)
    for name in (CSA_KV, scale_of(CSA_KV), rope_of(CSA_KV)):
        a, b = pooled.rows(name, 75), local.rows(name, 75)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    q, scale = kv_quant.quantize(values[:, :64], 64)
    page0 = pool.view(1, CSA_KV)[0]  # the sequence's second page: entries 32..63
    assert torch.equal(page0.view(torch.uint8), q[32:64].view(torch.uint8))
    assert torch.equal(pool.view(1, scale_of(CSA_KV))[0], scale[32:64])
    assert torch.equal(pool.view(1, rope_of(CSA_KV))[0], values[32:64, 64:])
    back = kv_quant.rows(pooled, CSA_KV, 75, form, torch.float32)
    assert torch.equal(back[:, 64:], values[:, 64:])
    assert ((back - values).abs() <= values.abs().amax(1, keepdim=True) / 16).all()


def test_the_flag_reaches_the_cache_config_and_launch_passes_it_on(builtin_dir) -> None:  # type: ignore[no-untyped-def]
    from pdserve import launch
    from pdserve.engine_flags import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    v4 = str(builtin_dir("deepseek-v4-tiny"))
    args = p.parse_args(["--model", v4, "--device", "cpu", "--kv-dtype", "fp8"])
    assert engine_config(args).cache.kv_dtype == "fp8"
    argv = launch.engine_flags(args)  # what `pdserve launch` gives each worker
    assert argv[argv.index("--kv-dtype") + 1] == "fp8"
    assert engine_config(p.parse_args(["--model", v4])).cache.kv_dtype == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-dtype", "int4"])
    with pytest.raises(ValueError, match="KV dtype must be one of"):
        CacheConfig(kv_dtype="fp4")
    assert config.KV_DTYPES == v4_layout.KV_DTYPES  # config's copy needs no torch
