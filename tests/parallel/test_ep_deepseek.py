"""DeepSeek-V3 and V3.2 at `--tp 2`: expert parallel (model/moe.py). Each rank loads its half of
every MoE layer's routed experts and nothing of the other half, runs latent attention (and
V3.2's indexer) whole over its own copy of the latent pages, and the ranks' expert outputs are
summed by one all-reduce a layer. Greedy tokens, logprobs and prompt logprobs equal TP 1's on
the TP tests' workload (18 prompts, preemptions included), up to float32 sums in another order.
"""

from __future__ import annotations

import pytest

from pdserve.model.config import ModelArch
from pdserve.model.moe import Experts
from tests.parallel.test_tp_engine import run, tp_engine, workload

pytestmark = pytest.mark.process  # follower ranks are processes


@pytest.mark.parametrize("name", ["deepseek-v3-tiny", "deepseek-v32-tiny"])
def test_expert_parallel_generates_what_tp1_generates(builtin_dir, name: str) -> None:
    path = builtin_dir(name)
    arch = ModelArch.from_dir(path)
    assert arch.moe is not None
    prompts, params = workload(arch.vocab_size)
    got = {}
    for tp in (1, 2):
        with tp_engine(path, tp) as engine:
            got[tp] = run(engine, prompts, params)
            experts = [m for m in engine.model.modules() if isinstance(m, Experts)]
            assert experts, name
            for e in experts:  # rank 0's half of the stack, and only that
                assert (e.first, e.count) == (0, arch.moe.num_experts // tp)
                assert e.gate_up_proj.shape[0] == e.down_proj.shape[0] == e.count
    for i, (one, two) in enumerate(zip(got[1], got[2], strict=True)):
        assert one[0] == two[0], f"request {i}: expert parallel's tokens differ"
        for a, b in zip(one[1] + one[2], two[1] + two[2], strict=True):
            bound = 1e-4 * max(1.0, abs(a.logprob))  # float32 sums in another order
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < bound, i
        assert one[3] == two[3] == "length", i
