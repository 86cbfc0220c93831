"""Expert parallel (model/moe.py): each rank's `Experts` holds its rows of the stack, loaded from
a stacked tensor (`load_shard`) or expert by expert (`load_index`, other ranks' experts
skipped), and adds only its experts' outputs; the ranks' outputs sum to the whole layer's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

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
