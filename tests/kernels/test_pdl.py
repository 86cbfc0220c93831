"""Programmatic dependent launch (kernels/pdl.py): when it is asked for, and that a chain of
PDL kernels computes the same bits as the same kernels launched plainly.

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


def _chain(x, res, w, gate_up, q, k_cache, v_cache, table, lens, out, po, pl):
    """Kernels back to back, each reading what the one before wrote: norm + residual add,
    SiLU·mul, split decode attention + its reduce, the greedy pick."""
    h = triton_fused.rms_norm(x, w, 1e-5, res)
    act = triton_fused.silu_mul(gate_up + h.repeat(1, 2))
    paged_decode(q * act[:, :64].unsqueeze(1), k_cache, v_cache, table, lens, out, 0.125, 4, po, pl)
    return h, act, out.clone(), argmax(out.flatten(1))


@pytest.mark.skipif(not HOPPER, reason="PDL needs an sm_90+ GPU")
def test_pdl_chain_equals_plain_launches_eager_and_in_a_graph(monkeypatch):
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(0)
    rows, heads, kv_heads, dim, page, pages = 6, 8, 2, 64, 16, 40

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=dev).to(torch.bfloat16)

    x, res, w, gate_up = rand(rows, 64), rand(rows, 64), rand(64), rand(rows, 128)
    q = rand(rows, heads, dim)
    k_cache, v_cache = rand(pages, page, kv_heads, dim), rand(pages, page, kv_heads, dim)
    table = torch.randperm(pages, device=dev)[: rows * 6].view(rows, 6).to(torch.int32)
    lens = torch.tensor([1, 17, 33, 64, 90, 96], dtype=torch.int32, device=dev)
    po = torch.empty(rows, heads, 4, dim, dtype=torch.float32, device=dev)
    pl = torch.empty(rows, heads, 4, dtype=torch.float32, device=dev)

    def run(on: bool):
        monkeypatch.setattr(pdl, "_enabled", {dev.index: on})
        out = torch.empty(rows, heads, dim, dtype=torch.bfloat16, device=dev)
        eager = _chain(x, res.clone(), w, gate_up, q, k_cache, v_cache, table, lens, out, po, pl)
        r = res.clone()
        _chain(x, r, w, gate_up, q, k_cache, v_cache, table, lens, out, po, pl)  # compiles
        r.copy_(res)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _chain(x, r, w, gate_up, q, k_cache, v_cache, table, lens, out, po, pl)
        r.copy_(res)
        graph.replay()
        torch.cuda.synchronize()
        return eager, captured

    plain_eager, plain_graph = run(False)
    pdl_eager, pdl_graph = run(True)
    for a, b, c, d in zip(plain_eager, plain_graph, pdl_eager, pdl_graph, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
