"""Programmatic dependent launch (kernels/pdl.py): when it is asked for, and that a chain of
PDL kernels computes the same bits as the same kernels launched plainly, with every input a
kernel takes from the one before starting as NaN, so that a kernel running early would show.

On the CPU the kernels run in Triton's interpreter, which has no griddepcontrol instructions:
`launch` must never ask for PDL there (every interpreter test would fail if it did). The
equality checks need an sm_90+ GPU: eagerly and replayed from a CUDA graph, PDL on vs off.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from pdserve.attention.triton_decode import paged_decode  # noqa: E402
from pdserve.attention.triton_store import rope_store_kv  # noqa: E402
from pdserve.engine.sampling.triton_argmax import argmax  # noqa: E402
from pdserve.kernels import pdl, triton_fused  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_no_pdl_on_the_cpu_or_in_the_interpreter():
    assert pdl.launch(torch.device("cpu"), triton_fused._rms_norm_kernel) == {"PDL": False}
    if not torch.cuda.is_available():  # conftest: the kernels are the interpreter's
        cuda = torch.device("cuda")
        assert pdl.launch(cuda, triton_fused._rms_norm_kernel) == {"PDL": False}


@pytest.mark.skipif(not HOPPER, reason="PDL needs an sm_90+ GPU")
def test_the_switch_reads_the_environment(monkeypatch):
    dev = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setattr(pdl, "_enabled", {})
    monkeypatch.setenv("PDSERVE_PDL", "0")
    assert pdl.launch(dev, triton_fused._rms_norm_kernel) == {"PDL": False}
    monkeypatch.setattr(pdl, "_enabled", {})
    monkeypatch.delenv("PDSERVE_PDL")
    assert pdl.launch(dev, triton_fused._rms_norm_kernel) == {"PDL": True, "launch_pdl": True}


ROWS, HEADS, KV_HEADS, DIM, PAGE, PAGES_PER_ROW, SPLITS = 32, 8, 2, 64, 16, 128, 4


def _chain(t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Triton kernels back to back, each reading what the one before wrote: RoPE + KV store,
    split decode attention and its reduce, RMSNorm + residual add over the attention output,
    SiLU·mul, the greedy pick (two kernels). Everything a kernel reads from the one before
    starts as NaN (plain fills, ahead of the chain): a kernel that ran early would read it."""
    q, k = t["q0"].clone(), t["k0"].clone()  # rotated in place
    t["po"].fill_(float("nan"))
    t["pl"].fill_(float("nan"))
    out = torch.full_like(q, float("nan"))
    res = t["res0"].clone()
    rope_store_kv(
        q, k, t["v"], t["k_cache"], t["v_cache"], t["slots"], t["positions"], t["inv_freq"]
    )
    paged_decode(
        q, t["k_cache"], t["v_cache"], t["table"], t["lens"], out, 0.125, SPLITS, t["po"], t["pl"]
    )
    h = triton_fused.rms_norm(out.view(ROWS, HEADS * DIM), t["w"], 1e-5, res)
    act = triton_fused.silu_mul(h)
    return [q, out, res, h, act, argmax(act)]


def _inputs(dev: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev).to(torch.bfloat16)

    pages = ROWS * PAGES_PER_ROW
    table = torch.randperm(pages, device=dev).view(ROWS, PAGES_PER_ROW).to(torch.int32)
    lens = torch.randint(1, PAGE * PAGES_PER_ROW + 1, (ROWS,), generator=g, device=dev)
    positions = (lens - 1).to(torch.int32)
    rows = torch.arange(ROWS, device=dev)
    slots = table[rows, positions // PAGE] * PAGE + positions % PAGE
    return {
        "q0": rand(ROWS, HEADS, DIM),
        "k0": rand(ROWS, KV_HEADS, DIM),
        "v": rand(ROWS, KV_HEADS, DIM),
        "k_cache": rand(pages, PAGE, KV_HEADS, DIM),
        "v_cache": rand(pages, PAGE, KV_HEADS, DIM),
        "table": table,
        "lens": lens.to(torch.int32),
        "positions": positions,
        "slots": slots.to(torch.int32),
        "inv_freq": 1.0 / (10000.0 ** (torch.arange(0, DIM, 2, device=dev) / DIM)),
        "res0": rand(ROWS, HEADS * DIM),
        "w": rand(HEADS * DIM),
        "po": torch.empty(ROWS, HEADS, SPLITS, DIM, dtype=torch.float32, device=dev),
        "pl": torch.empty(ROWS, HEADS, SPLITS, dtype=torch.float32, device=dev),
    }


@pytest.mark.skipif(not HOPPER, reason="PDL needs an sm_90+ GPU")
def test_pdl_chain_equals_plain_launches_eager_and_in_a_graph(monkeypatch):
    dev = torch.device("cuda", torch.cuda.current_device())
    t = _inputs(dev)

    def run(on: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        monkeypatch.setattr(pdl, "_enabled", {dev.index: on})
        eager = [x.clone() for x in _chain(t)]  # also compiles this setting's kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _chain(t)
        graph.replay()
        torch.cuda.synchronize()
        return eager, captured

    plain_eager, plain_graph = run(False)
    pdl_eager, pdl_graph = run(True)
    assert not plain_eager[1].isnan().any()  # the attention output was written everywhere
    for a, b, c, d in zip(plain_eager, plain_graph, pdl_eager, pdl_graph, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
