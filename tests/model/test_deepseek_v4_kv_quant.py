"""DeepSeek-V4's fp8 KV (model/deepseek_v4/kv_quant.py): the block quantisation's round trip
within e4m3's rounding, power-of-two scales; what the model stores in fp8 mode, component by
component, is the quantisation of the very values it computed (the rotary part those values
themselves, bit for bit), and the first compressed layer computes the same values as in the
model dtype; logits stay close to the float32 KV's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.kvcache.v4_layout import (
    CSA_INDEX_K,
    CSA_KV,
    HCA_KV,
    rope_of,
    scale_of,
    v4_buffers,
    v4_state,
)
from pdserve.model.deepseek_v4 import kv_quant
from pdserve.model.deepseek_v4.kv import LocalSeqKV, LocalStepKV, Span
from pdserve.model.deepseek_v4.kv_quant import Fp8Form, dequantize, quantize
from pdserve.model.deepseek_v4.model import DeepseekV4ForCausalLM
from pdserve.model.loader import load_model

FP8 = torch.float8_e4m3fn


def is_pow2(x: torch.Tensor) -> bool:
    mantissa, _ = torch.frexp(x)
    return bool((mantissa == 0.5).all())


@pytest.mark.parametrize("block", [64, 16, 100])
def test_round_trip_within_e4m3_rounding(block: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 100, generator=g) * torch.logspace(-6, 3, 50)[:, None]
    x[3, 7] = 5e4  # an outlier takes its own block's scale, not its neighbours'
    x[4] = 0.0
    q, scale = quantize(x, block)
    blocks = -(-100 // block)
    assert q.dtype == FP8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (50, blocks)
    assert is_pow2(scale)
    # The scale is the block's absmax / 448 rounded up to a power of two (a floor at zero).
    amax = torch.nn.functional.pad(x.abs(), (0, blocks * block - 100)).view(50, blocks, block)
    amax = amax.amax(-1).clamp(min=1e-4) / 448
    assert bool((scale >= amax).all()) and bool((scale < 2 * amax).all())
    back = dequantize(q, scale, block)
    per = scale.repeat_interleave(block, dim=1)[:, :100]
    # e4m3 keeps 3 mantissa bits (half an ulp: 2**-4 relative); below 2**-6 it is subnormal,
    # spaced 2**-9 apart.
    assert bool(((back - x).abs() <= torch.maximum(x.abs() * 2**-4, per * 2**-10)).all())
    assert bool((back[4] == 0).all())
    assert torch.equal(back.to(torch.bfloat16).float(), back)  # exact in bfloat16 too
    # Values an fp8 code times the scale already are come back exactly.
    assert torch.equal(dequantize(*quantize(back, block), block), back)


def test_the_last_block_is_the_rest_of_the_row() -> None:
    x = torch.ones(2, 100)
    x[:, 70] = 300.0  # in the second block (channels 64..99) only
    _, scale = quantize(x, 64)
    assert scale[:, 0].tolist() == [2.0**-8] * 2  # 1 / 448 rounded up
    assert scale[:, 1].tolist() == [1.0] * 2  # 300 / 448 rounded up


@pytest.fixture(scope="module")
def model(builtin_dir: Any) -> DeepseekV4ForCausalLM:
    m = load_model(Path(builtin_dir("deepseek-v4-tiny")), torch.float32, torch.device("cpu"))
    assert isinstance(m, DeepseekV4ForCausalLM)
    return m


def fresh(model: DeepseekV4ForCausalLM, kv_dtype: str) -> LocalSeqKV:
    v4 = model.v4
    return LocalSeqKV(
        {b.name: b for b in v4_buffers(v4, "float32", 128, kv_dtype)},
        {s.name: s for s in v4_state(v4, "float32")},
    )


def prefill(model: DeepseekV4ForCausalLM, kv: LocalSeqKV, prompt: torch.Tensor) -> torch.Tensor:
    """The prompt in chunks of 100 (entries arrive over several stores): logits [n, vocab]."""
    out = []
    with torch.no_grad():
        for at in range(0, len(prompt), 100):
            ids = prompt[at : at + 100]
            step = LocalStepKV([kv], [Span(0, len(ids), at)])
            out.append(
                model.compute_logits(model.forward_kv(ids, torch.arange(at, at + len(ids)), step))
            )
    return torch.cat(out)


def test_stored_parts_are_the_models_values_quantised(model, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    made: dict[tuple[int, str], list[torch.Tensor]] = {}  # the values the model stored
    real = kv_quant.store_rows

    def store_rows(seq, name, first, values, form):  # type: ignore[no-untyped-def]
        made.setdefault((seq.layer, name), []).append(values.clone())
        real(seq, name, first, values, form)

    monkeypatch.setattr(kv_quant, "store_rows", store_rows)
    prompt = torch.randint(3, 4000, (300,), generator=torch.Generator().manual_seed(1))
    fp8, auto = fresh(model, "fp8"), fresh(model, "auto")
    prefill(model, fp8, prompt)
    rope = model.v4.compress_rope.dim
    assert {name for _, name in made} == {CSA_KV, CSA_INDEX_K, HCA_KV}
    for (layer, name), parts in made.items():
        values = torch.cat(parts)
        stored = fp8.entries[(layer, name)]
        ratio = 128 if name == HCA_KV else 4
        assert stored.dtype == FP8 and len(stored) == len(values) == 300 // ratio
        kept, block = (0, values.shape[1]) if name == CSA_INDEX_K else (rope, 64)
        q, scale = quantize(values[:, : values.shape[1] - kept], block)
        assert torch.equal(stored.view(torch.uint8), q.view(torch.uint8)), (layer, name)
        assert torch.equal(fp8.entries[(layer, scale_of(name))], scale)
        if kept:
            assert torch.equal(fp8.entries[(layer, rope_of(name))], values[:, -kept:])
        else:
            assert (layer, rope_of(name)) not in fp8.entries
    # Layer 1 (the first compressed one) sees what it sees in the model dtype: its values are
    # those the float32 KV stores whole.
    monkeypatch.undo()
    prefill(model, auto, prompt)
    for name in (CSA_KV, CSA_INDEX_K):
        assert torch.equal(torch.cat(made[(1, name)]), auto.entries[(1, name)])
    got = kv_quant.rows(fp8.view(1), CSA_KV, 75, Fp8Form(rope, 64), torch.float32)
    assert torch.equal(got[:, -rope:], auto.entries[(1, CSA_KV)][:, -rope:])
    assert not torch.equal(got, auto.entries[(1, CSA_KV)])


def test_logits_stay_close_to_the_float32_kv(model) -> None:  # type: ignore[no-untyped-def]
    """Not equal: a quantised indexer key can flip one of the top-k entries a query keeps (the
    tiny model's random weights score many near ties), and then a position's logits move."""
    prompt = torch.randint(3, 4000, (300,), generator=torch.Generator().manual_seed(2))
    a, b = prefill(model, fresh(model, "auto"), prompt), prefill(model, fresh(model, "fp8"), prompt)
    assert not torch.equal(a, b)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.85
    assert (a - b).abs().mean() < 0.02 * a.abs().max()
