"""Checkpoint tensor names -> model parameters: one rule table per architecture.

`plan()` pairs every checkpoint tensor with its destination before a byte is read. Each
checkpoint name goes to the first rule (in table order) whose pattern fully matches it:
  * Rename: the tensor is one whole parameter (the identity is Rename(r"(.*)", r"\\1"));
  * Concat: N tensors fill consecutive slices of one parameter along `dim`, in the order of
    the rule's patterns, each slice as wide as its tensor (a fused QKV or gate-up weight);
  * Stack: per-expert tensors fill index `expert` of one parameter along `dim` (stacked MoE
    experts);
  * StackConcat: both at once: per-expert tensors, source i filling slice i of index `expert`
    (per-expert gate and up into stacked experts' gate_up_proj [E, 2I, H]);
  * Ignore: tensors the model derives itself (RoPE tables that some exporters write);
  * Rewrite: not a placement; the name the later rules see is rewritten (DeepSeek-V4's own
    tensor names, converted step by step as HF converts them).
Targets are `re.Match.expand` templates over the pattern's groups.

Invariant of a plan: every parameter is covered exactly once and completely, by tensors whose
shapes fit their destinations; anything else is a ModelConfigError that names the tensor or
parameter. The Llama family's table fuses q/k/v and gate/up and renames the rest identically.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from pdserve.model.config import ModelConfigError
from pdserve.model.deepseek_v4.weight_names import DEEPSEEK_V4_RULES
from pdserve.model.weight_rules import LAYER as _LAYER
from pdserve.model.weight_rules import (
    Concat,
    Ignore,
    Rename,
    Rewrite,
    Rule,
    Stack,
    StackConcat,
)

Shape = tuple[int, ...]


# The Llama family (Llama, Mistral, Qwen2, Qwen3): HF names, but q/k/v and gate/up are fused
# (model/llama.py): each fused parameter is the checkpoint's tensors stacked along dim 0.
_HF_LAYOUT: tuple[Rule, ...] = (
    Ignore(r".*rotary_emb\.inv_freq"),
    Concat(
        tuple(rf"{_LAYER}\.self_attn\.{p}_proj\.(weight|bias)" for p in "qkv"),
        r"\1.self_attn.qkv_proj.\2",
        dim=0,
    ),
    Concat(
        tuple(rf"{_LAYER}\.mlp\.{p}_proj\.(weight|bias)" for p in ("gate", "up")),
        r"\1.mlp.gate_up_proj.\2",
        dim=0,
    ),
    Rename(r"(.*)", r"\1"),
)

# DeepSeek-V3 (model/deepseek_v3.py): gate and up fused in the dense MLPs and the shared
# experts; routed experts stacked, from per-expert tensors (what HF's save_pretrained and the
# real checkpoints write) or already stacked (HF 5's in-memory names load by identity).
_EXPERT = rf"{_LAYER}\.mlp\.experts\.(?P<expert>\d+)"
_DEEPSEEK_V3: tuple[Rule, ...] = (
    Ignore(r".*rotary_emb\.inv_freq"),
    Concat(
        tuple(rf"{_LAYER}\.mlp\.((?:shared_experts\.)?){p}_proj\.weight" for p in ("gate", "up")),
        r"\1.mlp.\2gate_up_proj.weight",
        dim=0,
    ),
    StackConcat(
        tuple(rf"{_EXPERT}\.{p}_proj\.weight" for p in ("gate", "up")),
        r"\1.mlp.experts.gate_up_proj",
    ),
    Stack(rf"{_EXPERT}\.down_proj\.weight", r"\1.mlp.experts.down_proj"),
    Rename(r"(.*)", r"\1"),
)

WEIGHT_MAP: dict[str, tuple[Rule, ...]] = {
    "LlamaForCausalLM": _HF_LAYOUT,
    "MistralForCausalLM": _HF_LAYOUT,
    "Qwen2ForCausalLM": _HF_LAYOUT,
    "Qwen3ForCausalLM": _HF_LAYOUT,
    "DeepseekV3ForCausalLM": _DEEPSEEK_V3,
    # V3 plus `self_attn.indexer.{wq_b,wk,k_norm,weights_proj}`, loaded by name
    "DeepseekV32ForCausalLM": _DEEPSEEK_V3,
    "DeepseekV4ForCausalLM": DEEPSEEK_V4_RULES,
}


def rules_for(architecture: str) -> tuple[Rule, ...]:
    if architecture not in WEIGHT_MAP:
        raise ModelConfigError(
            f"no checkpoint weight map for architecture {architecture!r}; "
            f"known: {sorted(WEIGHT_MAP)}"
        )
    return WEIGHT_MAP[architecture]


# ---------------------------------------------------------------- destinations


@dataclass(frozen=True)
class Whole:
    pass


@dataclass(frozen=True)
class Slice:
    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class Index:
    dim: int
    index: int


@dataclass(frozen=True)
class IndexSlice:
    """Slice [start, start + length) along `cat_dim` of index `index` along `dim`."""

    dim: int
    index: int
    cat_dim: int
    start: int
    length: int


Region = Whole | Slice | Index | IndexSlice


@dataclass(frozen=True)
class Placement:
    """Checkpoint tensor `source` is copied into `region` of parameter `target`."""

    source: str
    target: str
    region: Region

    def destination(self, param: torch.Tensor) -> torch.Tensor:
        """The view of `param` that the source tensor fills (aliases param's storage)."""
        match self.region:
            case Slice(dim, start, length):
                return param.narrow(dim, start, length)
            case Index(dim, index):
                return param.select(dim, index)
            case IndexSlice(dim, index, cat_dim, start, length):
                return param.select(dim, index).narrow(cat_dim, start, length)
            case _:
                return param


def region_shape(region: Region, param: Shape) -> Shape:
    match region:
        case Slice(dim, _, length):
            return param[:dim] + (length,) + param[dim + 1 :]
        case Index(dim, _):
            return param[:dim] + param[dim + 1 :]
        case IndexSlice(dim, _, cat_dim, _, length):
            row = param[:dim] + param[dim + 1 :]
            return row[:cat_dim] + (length,) + row[cat_dim + 1 :]
        case _:
            return param


def _examples(names: Collection[str]) -> str:
    listed = sorted(names)
    more = f" and {len(listed) - 5} more" if len(listed) > 5 else ""
    return ", ".join(listed[:5]) + more


# ---------------------------------------------------------------- planning


def plan(
    checkpoint: Mapping[str, Shape],
    params: Mapping[str, Shape],
    rules: Sequence[Rule],
    aliases: Collection[str] = (),
    where: str = "checkpoint",
    stored_as: Mapping[str, str] | None = None,
) -> list[Placement]:
    """Where each checkpoint tensor goes. `aliases`: names of tied parameters (lm_head.weight
    when tied to embed_tokens); a checkpoint tensor that maps to one is a copy and is skipped.
    `stored_as`: how a tensor is stored when `checkpoint` gives it another shape (packed fp4
    is planned unpacked), said in a shape error.
    Raises ModelConfigError for a tensor with no parameter, a parameter with no tensor, a
    parameter covered twice or partly, and a shape that does not fit."""
    placements: list[Placement] = []
    unexpected: list[str] = []
    # (rule index, target) -> the Concat rule and {slice position: checkpoint name}
    groups: dict[tuple[int, str], tuple[Concat, dict[int, str]]] = {}
    # (rule index, target, expert) -> the StackConcat rule and {slice position: name}
    expert_groups: dict[tuple[int, str, int], tuple[StackConcat, dict[int, str]]] = {}
    for name in sorted(checkpoint):
        hit = _first_match(rules, name)
        if hit is None:
            unexpected.append(name)
            continue
        k, rule, m, pos = hit
        if isinstance(rule, Ignore):
            continue
        target = m.expand(rule.target)
        if target in aliases:
            continue
        if target not in params:
            unexpected.append(name)
        elif isinstance(rule, Concat | StackConcat):
            if isinstance(rule, Concat):
                members = groups.setdefault((k, target), (rule, {}))[1]
            else:
                key = (k, target, int(m.group("expert")))
                members = expert_groups.setdefault(key, (rule, {}))[1]
            if pos in members:
                raise ModelConfigError(
                    f"{where}: parameter {target} is loaded more than once: both "
                    f"{members[pos]} and {name} match {rule.sources[pos]}"
                )
            members[pos] = name
        elif isinstance(rule, Stack):
            placements.append(Placement(name, target, Index(rule.dim, pos)))
        else:
            placements.append(Placement(name, target, Whole()))
    if unexpected:
        raise ModelConfigError(
            f"{where}: {len(unexpected)} tensors match no parameter of this model: "
            f"{_examples(unexpected)}"
        )
    for (_, target), (concat, members) in sorted(groups.items(), key=lambda kv: kv[0]):
        placements.extend(_concat(concat, target, members, checkpoint, where))
    for (_, target, e), (sc, members) in sorted(expert_groups.items(), key=lambda kv: kv[0]):
        for p in _concat(sc, target, members, checkpoint, where, dim=sc.cat_dim):
            assert isinstance(p.region, Slice)
            r = IndexSlice(sc.dim, e, sc.cat_dim, p.region.start, p.region.length)
            placements.append(Placement(p.source, target, r))
    for p in placements:
        want = region_shape(p.region, params[p.target])
        if tuple(checkpoint[p.source]) != want:
            how = (stored_as or {}).get(p.source)
            raise ModelConfigError(
                f"{where}: tensor {p.source} has shape {tuple(checkpoint[p.source])}"
                f"{f' ({how})' if how else ''}, but parameter {p.target} needs {want} there "
                "(from config.json)"
            )
    _check_coverage(placements, params, where)
    return placements


def _first_match(rules: Sequence[Rule], name: str) -> tuple[int, Rule, re.Match[str], int] | None:
    """(rule index, rule, match, position): position is the slice for Concat, the expert
    for Stack, 0 otherwise. Rewrite rules change the name the later rules match."""
    for k, rule in enumerate(rules):
        if isinstance(rule, Rewrite):
            name = re.sub(rule.source, rule.target, name)
            continue
        if isinstance(rule, Concat | StackConcat):
            for pos, pattern in enumerate(rule.sources):
                m = re.fullmatch(pattern, name)
                if m:
                    return k, rule, m, pos
            continue
        m = re.fullmatch(rule.source, name)
        if m is not None:
            return k, rule, m, int(m.group("expert")) if isinstance(rule, Stack) else 0
    return None


def _concat(
    rule: Concat | StackConcat,
    target: str,
    members: dict[int, str],
    checkpoint: Mapping[str, Shape],
    where: str,
    dim: int | None = None,
) -> list[Placement]:
    """Slices along `dim` (default: the rule's) of `target`, one per source in order."""
    dim = rule.dim if dim is None and isinstance(rule, Concat) else dim
    assert dim is not None
    absent = [rule.sources[i] for i in range(len(rule.sources)) if i not in members]
    if absent:
        raise ModelConfigError(
            f"{where}: parameter {target} is fused from {len(rule.sources)} tensors, but no "
            f"tensor matches {' or '.join(absent)}; found {', '.join(sorted(members.values()))}"
        )
    out, start = [], 0
    for pos in range(len(rule.sources)):
        name = members[pos]
        shape = tuple(checkpoint[name])
        if not 0 <= dim < len(shape):
            raise ModelConfigError(
                f"{where}: tensor {name} has shape {shape}, no dim {dim} to fuse along"
            )
        out.append(Placement(name, target, Slice(dim, start, shape[dim])))
        start += shape[dim]
    return out


def _check_coverage(placements: list[Placement], params: Mapping[str, Shape], where: str) -> None:
    by_target: dict[str, list[Placement]] = defaultdict(list)
    for p in placements:
        by_target[p.target].append(p)
    missing = sorted(set(params) - set(by_target))
    if missing:
        raise ModelConfigError(
            f"{where}: checkpoint lacks {len(missing)} tensors for parameters {_examples(missing)}"
        )
    for target, ps in sorted(by_target.items()):
        sources = [p.source for p in ps]
        kinds = {type(p.region) for p in ps}
        dims = {p.region.dim for p in ps if not isinstance(p.region, Whole)}
        if len(kinds) > 1 or len(dims) > 1 or (kinds == {Whole} and len(ps) > 1):
            raise ModelConfigError(
                f"{where}: parameter {target} is loaded more than once, from {sources}"
            )
        if kinds == {Whole}:
            continue
        (dim,) = dims
        size = params[target][dim]
        if kinds == {Index}:
            got = sorted(p.region.index for p in ps if isinstance(p.region, Index))
            covered = got == list(range(size))
        elif kinds == {IndexSlice}:
            covered = _stacked_slices_tile(ps, size, params[target])
        else:
            spans = sorted(
                (p.region.start, p.region.length) for p in ps if isinstance(p.region, Slice)
            )
            ends = [s + n for s, n in spans]
            covered = [s for s, _ in spans] == [0, *ends[:-1]] and ends[-1] == size
        if not covered:
            raise ModelConfigError(
                f"{where}: tensors {sorted(sources)} do not tile parameter {target} "
                f"(size {size} along dim {dim}) exactly once"
            )


def _stacked_slices_tile(ps: list[Placement], size: int, shape: Shape) -> bool:
    """IndexSlice placements cover every index 0..size-1, each index's slices tiling it."""
    regions = [p.region for p in ps if isinstance(p.region, IndexSlice)]
    by_index: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for r in regions:
        by_index[r.index].append((r.start, r.length))
    cat_dims = {r.cat_dim for r in regions}
    if sorted(by_index) != list(range(size)) or len(cat_dims) != 1:
        return False
    (cat_dim,) = cat_dims
    dim = regions[0].dim
    row = shape[:dim] + shape[dim + 1 :]  # one index's part
    for spans in by_index.values():
        spans.sort()
        ends = [s + n for s, n in spans]
        if [s for s, _ in spans] != [0, *ends[:-1]] or ends[-1] != row[cat_dim]:
            return False
    return True
