"""Expert parallel (model/moe.py): each rank's `Experts` holds its rows of the stack, loaded from
a stacked tensor (`load_shard`) or expert by expert (`load_index`, other ranks' experts
skipped), and adds only its experts' outputs; the ranks' outputs sum to the whole layer's."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pdserve.kernels.ops import FUSED_MOE_ENV
from pdserve.model.deepseek_config import MoEArch
from pdserve.model.moe import Experts, TopkRouter

H = 16
MOE = MoEArch(8, 3, 2, 1, True, 2.5, 12, 1, 0)


def fake(rank: int, world: int) -> Any:
    """What Experts reads of a RankGroup, without a process group."""
    return SimpleNamespace(rank=rank, world_size=world)


def whole_layer(seed: int) -> Experts:
    g = torch.Generator().manual_seed(seed)
    e = Experts(MOE, H)
    with torch.no_grad():
        e.gate_up_proj.copy_(torch.randn(e.gate_up_proj.shape, generator=g) * 0.3)
        e.down_proj.copy_(torch.randn(e.down_proj.shape, generator=g) * 0.3)
    return e


@pytest.mark.parametrize("world", [2, 4])
def test_the_ranks_outputs_sum_to_the_whole_layers(world: int) -> None:
    whole = whole_layer(world)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(11, H, generator=g)
    router = TopkRouter(MOE, H)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.zero_()
    weights, ids = router(x)
    want = whole(x, ids, weights)
    total = torch.zeros_like(want)
    for r in range(world):
        part = Experts(MOE, H, fake(r, world))
        assert (part.first, part.count) == (r * 8 // world, 8 // world)
        part.load_shard("gate_up_proj", whole.gate_up_proj.detach())  # a stacked checkpoint
        for i in range(8):  # one tensor an expert: only this rank's land
            part.load_index("down_proj", whole.down_proj[i].detach(), i)
        rows = slice(part.first, part.first + part.count)
        assert torch.equal(part.gate_up_proj, whole.gate_up_proj[rows])
        assert torch.equal(part.down_proj, whole.down_proj[rows])
        assert [part.holds_index("down_proj", i) for i in range(8)] == [
            rows.start <= i < rows.stop for i in range(8)
        ]
        total += part(x, ids, weights)
    torch.testing.assert_close(total, want, rtol=1e-6, atol=1e-6)  # sums in another order


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_fused_kernels_skip_the_other_ranks_assignments(monkeypatch) -> None:
    """kernels/triton_moe.py on an expert-parallel rank (Triton's interpreter on the CPU): the
    other ranks' assignments, id E (nobody's), are in no block and no token's sum; several
    per token, so their slots tie. Equal to the torch loop over this rank's experts."""
    whole = whole_layer(3)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(13, H, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(13)])  # distinct
    weights = torch.rand(13, 3, generator=g)
    # the kernels compile on a GPU and run in the interpreter on the CPU
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, ids, weights = x.to(device), ids.to(device), weights.to(device)
    for r in range(2):
        part = Experts(MOE, H, fake(r, 2))
        part.load_shard("gate_up_proj", whole.gate_up_proj.detach())
        part.load_shard("down_proj", whole.down_proj.detach())
        part.to(device)
        monkeypatch.setenv(FUSED_MOE_ENV, "0")
        want = part(x, ids, weights)
        monkeypatch.setenv(FUSED_MOE_ENV, "1")
        got = part(x, ids, weights)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert want.abs().sum() > 0
