"""Data-parallel attention's token exchange (`--dp N`): each rank attends its own requests; the
MoE layers between see every rank's tokens.

A step's sequences are split over the ranks: the leader's plan says which rank attends each
(parallel/step_record.py `SeqPlan.rank`), so every rank knows every rank's token count, and
rank r holds `counts[r]` rows of hidden states. A MoE layer (model/moe.py) gathers every rank's
rows (`gather`: [sum(counts), H], rank 0's first), routes them all and runs this rank's share
of the experts on them; the ranks' partial outputs are then summed and each keeps its own rows
(`own_sum`). Together an all-gather and a reduce-scatter, each rank's experts see each token
once, and which experts a token goes to is the same decision on every rank (the same gate on
the same rows).

A rank with no tokens this step still joins each exchange, with none of its own (the model's
`idle` forward): every rank enters the same collectives, by construction. Rows are padded to the
step's largest count for both collectives, which need one shape on every rank.

`begin` is called with the step's counts before each forward, by the runner, on every rank
(engine/dp_step.py). Nothing here decides anything: the counts are the leader's plan.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.parallel.group import RankGroup


class DpTokens:
    """One rank's view of the step's tokens over its data-parallel group."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.counts: tuple[int, ...] = ()

    def begin(self, counts: Sequence[int]) -> None:
        """The step's token count of each rank (its plan's spans, rank by rank)."""
        if len(counts) != self.group.world_size or min(counts) < 0:
            raise ValueError(
                f"a step's token counts {list(counts)} are not one count per rank of "
                f"{self.group.world_size}"
            )
        self.counts = tuple(counts)

    @property
    def own(self) -> int:
        """This rank's tokens this step."""
        return self.counts[self.group.rank]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows [own, H] -> every rank's [sum(counts), H], rank by rank."""
        self._check(x, self.own)
        most = max(self.counts)
        if most == 0 or self.group.world_size == 1:
            return x
        padded = x.new_zeros(most, *x.shape[1:])
        padded[: x.shape[0]] = x
        every = self.group.all_gather_rows(padded)  # [world * most, H]
        keep = [every[r * most : r * most + n] for r, n in enumerate(self.counts)]
        return torch.cat(keep)

    def own_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's partial result for every row [sum(counts), H] -> their sum, this
        rank's rows only [own, H]."""
        self._check(x, sum(self.counts))
        most = max(self.counts)
        if most == 0 or self.group.world_size == 1:
            return x
        padded = x.new_zeros(self.group.world_size * most, *x.shape[1:])  # rank r's at r * most
        at = 0
        for r, n in enumerate(self.counts):
            padded[r * most : r * most + n] = x[at : at + n]
            at += n
        return self.group.reduce_scatter_rows(padded)[: self.own]

    def _check(self, x: torch.Tensor, rows: int) -> None:
        if not self.counts:
            raise RuntimeError("a data-parallel exchange before the step's counts (begin)")
        if x.shape[0] != rows:
            raise ValueError(f"{x.shape[0]} rows where the step's counts give {rows}")
