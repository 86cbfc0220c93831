"""The checkpoint name map on tiny fake tensors: rename, concat into slices, stack, refusals."""

from __future__ import annotations

import re

import pytest
import torch

from pdserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfigError
from pdserve.model.weight_map import (
    WEIGHT_MAP,
    Concat,
    Ignore,
    Index,
    Placement,
    Rename,
    Slice,
    Stack,
    Whole,
    plan,
    rules_for,
)

IDENTITY = (Ignore(r".*rotary_emb\.inv_freq"), Rename(r"(.*)", r"\1"))
QKV = Concat(
    (r"l\.(\d+)\.q\.weight", r"l\.(\d+)\.k\.weight", r"l\.(\d+)\.v\.weight"), r"l.\1.qkv", dim=0
)
EXPERTS = Stack(r"l\.(\d+)\.experts\.(?P<expert>\d+)\.w", r"l.\1.experts_w", dim=0)


def shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in tensors.items()}


def fake(*shape: int, seed: int) -> torch.Tensor:
    return torch.arange(seed * 1000, seed * 1000 + torch.Size(shape).numel()).reshape(shape)


def load(
    tensors: dict[str, torch.Tensor], params: dict[str, tuple[int, ...]], rules, aliases=()
) -> dict[str, torch.Tensor]:
    """What the loader does, in memory: plan, then copy each tensor into its destination."""
    placements = plan(shapes(tensors), params, rules, aliases)
    out = {n: torch.full(s, -1, dtype=torch.int64) for n, s in params.items()}
    for p in placements:
        p.destination(out[p.target]).copy_(tensors[p.source])
    return out


def test_identity_and_rename():
    tensors = {"a.weight": fake(2, 3, seed=1), "old.b": fake(4, seed=2)}
    rules = (Rename(r"old\.(.*)", r"new.\1"), *IDENTITY)
    out = load(tensors, {"a.weight": (2, 3), "new.b": (4,)}, rules)
    assert torch.equal(out["new.b"], tensors["old.b"])
    out = load(tensors, {"a.weight": (2, 3), "old.b": (4,)}, IDENTITY)
    assert torch.equal(out["a.weight"], tensors["a.weight"])
    assert plan(shapes(tensors), {"a.weight": (2, 3), "old.b": (4,)}, IDENTITY) == [
        Placement("a.weight", "a.weight", Whole()),
        Placement("old.b", "old.b", Whole()),
    ]


def test_concat_fills_consecutive_slices_in_rule_order():
    # q is wider than k and v, as with grouped-query attention; names sort v < q < k never
    # matters: slice order is the order of the rule's patterns.
    tensors = {
        f"l.{i}.{n}.weight": fake(rows, 3, seed=10 * i + s)
        for i in range(2)
        for s, (n, rows) in enumerate((("q", 4), ("k", 2), ("v", 2)))
    }
    params = {"l.0.qkv": (8, 3), "l.1.qkv": (8, 3)}
    out = load(tensors, params, (QKV,))
    for i in range(2):
        want = torch.cat([tensors[f"l.{i}.{n}.weight"] for n in "qkv"], dim=0)
        assert torch.equal(out[f"l.{i}.qkv"], want)
    regions = {p.source: p.region for p in plan(shapes(tensors), params, (QKV,))}
    assert regions["l.0.k.weight"] == Slice(0, 4, 2) and regions["l.0.v.weight"] == Slice(0, 6, 2)


def test_concat_along_dim_1_writes_strided_slices():
    gate_up = Concat((r"(.*)\.gate", r"(.*)\.up"), r"\1.gate_up", dim=1)
    tensors = {"m.gate": fake(3, 2, seed=1), "m.up": fake(3, 5, seed=2)}
    out = load(tensors, {"m.gate_up": (3, 7)}, (gate_up,))
    assert torch.equal(out["m.gate_up"], torch.cat([tensors["m.gate"], tensors["m.up"]], dim=1))


@pytest.mark.parametrize("dim", [0, 1])
def test_stack_puts_each_expert_at_its_index(dim):
    # Expert 10 sorts before expert 2 by name: the index comes from the number, not the order.
    tensors = {f"l.0.experts.{e}.w": fake(2, 3, seed=e) for e in range(12)}
    rule = Stack(EXPERTS.source, EXPERTS.target, dim=dim)
    shape = (12, 2, 3) if dim == 0 else (2, 12, 3)
    out = load(tensors, {"l.0.experts_w": shape}, (rule,))
    want = torch.stack([tensors[f"l.0.experts.{e}.w"] for e in range(12)], dim=dim)
    assert torch.equal(out["l.0.experts_w"], want)
    assert Placement("l.0.experts.10.w", "l.0.experts_w", Index(dim, 10)) in plan(
        shapes(tensors), {"l.0.experts_w": shape}, (rule,)
    )


def test_ignored_and_tied_copies_are_skipped():
    tensors = {
        "emb": fake(4, 2, seed=1),
        "head": fake(4, 2, seed=2),
        "rotary_emb.inv_freq": fake(1, seed=3),
    }
    placements = plan(shapes(tensors), {"emb": (4, 2)}, IDENTITY, aliases={"head"})
    assert placements == [Placement("emb", "emb", Whole())]


def test_first_matching_rule_wins():
    rules = (Rename(r"x", r"special"), Rename(r"(.*)", r"\1"))
    assert plan({"x": (1,), "y": (1,)}, {"special": (1,), "y": (1,)}, rules)[0].target == "special"


def test_extra_tensor_is_named():
    tensors = {"a": fake(2, seed=1), "stray.weight": fake(2, seed=2)}
    with pytest.raises(ModelConfigError, match=r"1 tensors match no parameter.*stray\.weight"):
        plan(shapes(tensors), {"a": (2,)}, IDENTITY)
    with pytest.raises(ModelConfigError, match="match no parameter.*stray"):
        plan(shapes(tensors), {"a": (2,)}, (Rename(r"a", r"a"),))  # no rule matches at all


def test_missing_parameter_is_named():
    with pytest.raises(ModelConfigError, match=r"lacks 1 tensors for parameters b\.weight"):
        plan({"a": (2,)}, {"a": (2,), "b.weight": (3,)}, IDENTITY)


def test_wrong_shape_names_tensor_and_both_shapes():
    with pytest.raises(ModelConfigError, match=r"tensor a has shape \(2, 4\).*a needs \(2, 3\)"):
        plan({"a": (2, 4)}, {"a": (2, 3)}, IDENTITY)
    # A concat member: its slice's shape is the parameter's with the fused dim replaced.
    tensors = {"l.0.q.weight": (4, 3), "l.0.k.weight": (2, 5), "l.0.v.weight": (2, 3)}
    with pytest.raises(ModelConfigError, match=r"l\.0\.k\.weight has shape \(2, 5\).*\(2, 3\)"):
        plan(tensors, {"l.0.qkv": (8, 3)}, (QKV,))


def test_concat_refusals():
    part = {"l.0.q.weight": (4, 3), "l.0.v.weight": (2, 3)}
    missing_k = re.escape(QKV.sources[1])
    with pytest.raises(ModelConfigError, match=rf"qkv is fused from 3.*matches {missing_k}; found"):
        plan(part, {"l.0.qkv": (8, 3)}, (QKV,))
    full = {**part, "l.0.k.weight": (2, 3)}
    with pytest.raises(ModelConfigError, match=r"do not tile parameter l\.0\.qkv \(size 9"):
        plan(full, {"l.0.qkv": (9, 3)}, (QKV,))
    with pytest.raises(ModelConfigError, match=r"do not tile parameter l\.0\.qkv \(size 7"):
        plan(full, {"l.0.qkv": (7, 3)}, (QKV,))


def test_stack_refusals():
    two = {"l.0.experts.0.w": (2,), "l.0.experts.2.w": (2,)}
    with pytest.raises(ModelConfigError, match=r"do not tile parameter l\.0\.experts_w"):
        plan(two, {"l.0.experts_w": (2, 2)}, (EXPERTS,))  # expert 1 missing, 2 out of range
    with pytest.raises(ModelConfigError, match=r"do not tile.*size 3"):
        plan(two, {"l.0.experts_w": (3, 2)}, (EXPERTS,))
    with pytest.raises(ValueError, match="no .*expert"):
        Stack(r"l\.(\d+)\.w", r"x")


def test_a_parameter_loaded_twice_is_refused():
    # The fused parameter also stored whole: the slices and the whole tensor overlap.
    tensors = {
        "l.0.qkv": (8, 3),
        "l.0.q.weight": (4, 3),
        "l.0.k.weight": (2, 3),
        "l.0.v.weight": (2, 3),
    }
    with pytest.raises(ModelConfigError, match=r"l\.0\.qkv is loaded more than once"):
        plan(tensors, {"l.0.qkv": (8, 3)}, (QKV, *IDENTITY))
    with pytest.raises(ModelConfigError, match="loaded more than once"):
        plan({"a": (2,), "b": (2,)}, {"p": (2,)}, (Rename(r".*", "p"),))
    # Two tensors for one slice of a fused parameter.
    tensors = {"l.0.q.weight": (4, 3), "l.00.q.weight": (4, 3), "l.0.k.weight": (2, 3)}
    tensors["l.0.v.weight"] = (2, 3)
    with pytest.raises(ModelConfigError, match=r"both l\.0\.q\.weight and l\.00\.q\.weight"):
        plan(tensors, {"l.0.qkv": (8, 3)}, (Concat(QKV.sources, "l.0.qkv", dim=0),))


def test_every_supported_architecture_has_a_table_and_others_are_refused():
    assert set(WEIGHT_MAP) == set(SUPPORTED_ARCHITECTURES)
    qwen2 = rules_for("Qwen2ForCausalLM")
    assert qwen2 == rules_for("LlamaForCausalLM") and qwen2[0] == IDENTITY[0]
    assert qwen2[-1] == IDENTITY[-1]  # fused q/k/v and gate/up, the rest renamed as it is
    fused = plan(
        {
            f"model.layers.3.self_attn.{p}_proj.bias": (n,)
            for p, n in zip("qkv", (4, 2, 2), strict=True)
        }
        | {
            "model.layers.3.mlp.gate_proj.weight": (5, 3),
            "model.layers.3.mlp.up_proj.weight": (5, 3),
        },
        {
            "model.layers.3.self_attn.qkv_proj.bias": (8,),
            "model.layers.3.mlp.gate_up_proj.weight": (10, 3),
        },
        qwen2,
    )
    assert sorted((pl.source, pl.target) for pl in fused) == [
        ("model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.gate_up_proj.weight"),
        ("model.layers.3.mlp.up_proj.weight", "model.layers.3.mlp.gate_up_proj.weight"),
        ("model.layers.3.self_attn.k_proj.bias", "model.layers.3.self_attn.qkv_proj.bias"),
        ("model.layers.3.self_attn.q_proj.bias", "model.layers.3.self_attn.qkv_proj.bias"),
        ("model.layers.3.self_attn.v_proj.bias", "model.layers.3.self_attn.qkv_proj.bias"),
    ]
    with pytest.raises(ModelConfigError, match="'GPT2LMHeadModel'"):
        rules_for("GPT2LMHeadModel")
