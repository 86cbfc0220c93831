"""The kinds of rule a checkpoint's weight table is written in (model/weight_map.py applies
them; its docstring says what each places)."""

from __future__ import annotations

import re
from dataclasses import dataclass

LAYER = r"(model\.layers\.\d+)"  # a decoder layer's name prefix, as a group


@dataclass(frozen=True)
class Rename:
    source: str  # regex, full match
    target: str  # expand template


@dataclass(frozen=True)
class Concat:
    sources: tuple[str, ...]  # one regex per slice, in slice order
    target: str  # expand template over each source's own match; equal targets form one group
    dim: int


@dataclass(frozen=True)
class Stack:
    source: str  # regex with a group named "expert": the index along `dim`
    target: str
    dim: int = 0

    def __post_init__(self) -> None:
        if "expert" not in re.compile(self.source).groupindex:
            raise ValueError(f"Stack pattern {self.source!r} has no (?P<expert>...) group")


@dataclass(frozen=True)
class StackConcat:
    sources: tuple[str, ...]  # one regex per slice, each with a group named "expert"
    target: str
    dim: int = 0  # the expert dimension of the parameter
    cat_dim: int = 0  # the slices' dimension within one expert's part

    def __post_init__(self) -> None:
        for s in self.sources:
            if "expert" not in re.compile(s).groupindex:
                raise ValueError(f"StackConcat pattern {s!r} has no (?P<expert>...) group")


@dataclass(frozen=True)
class Ignore:
    source: str


@dataclass(frozen=True)
class Rewrite:
    """Not a placement: every match of `source` in the name is replaced (re.sub), and the
    later rules see the rewritten name (a checkpoint's own naming, normalised step by step)."""

    source: str
    target: str


Rule = Rename | Concat | Stack | StackConcat | Ignore | Rewrite
