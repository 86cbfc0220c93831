"""Tensor-parallel layers: each rank holds a shard of a layer's weight and a collective makes
the layer's output whole again.

  * ColumnParallelLinear: output features split; each rank's output is its slice (no
    collective). A fused weight (q|k|v, gate|up) is split per part: each rank gets its own
    q, k and v rows, never one block of the concatenation. Parts come in whole units (heads);
    a part with fewer units than ranks (KV heads) is replicated: each rank holds the one unit
    its share of the other parts needs (rank r of N: unit r * units // N).
  * RowParallelLinear: input features split; each rank's product is a partial sum, all-reduced,
    then the bias added once.
  * VocabParallelEmbedding: vocab rows split (ceil(V / N) a rank, the last padded); a rank
    embeds the ids in its rows, zeros elsewhere, and the sum over ranks is the embedding.
  * ParallelLMHead: vocab rows split like the embedding (so a tied head shares its shard);
    each rank's logits are gathered along the vocab and the padding cut off.

Parameters keep HF's names (`weight`, `bias`) and are this rank's shard. The loader plans a
checkpoint against `whole_shape` (the checkpoint's shapes) and hands each tensor to
`load_shard`, which copies only this rank's part (model/loader.py). Nothing here knows a model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.parallel.group import RankGroup

# A weight product: (x [N, in], weight [out, in], bias [out] or None) -> [N, out]. F.linear, or
# the model's fused kernels (kernels/ops.py), which this layer cannot import.
Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class ShardError(ValueError):
    """A layer that does not split over the group: the numbers say which and why."""


@dataclass(frozen=True)
class Part:
    """`size` features of the whole layer, in `units` equal blocks that are never cut: heads
    (head_dim features each) for q, k and v, single features for the MLP."""

    size: int
    units: int

    def rows(self, group: RankGroup, replicate: bool = False) -> range:
        """The features of this part (from 0) that `group.rank` holds: units / N whole units,
        or, with `replicate` and fewer units than ranks, the one unit rank r's share of a
        part with N units reads (unit r * units // N)."""
        n, r = group.world_size, group.rank
        if self.units < 1 or self.size % self.units:
            raise ShardError(f"{self.size} features are not {self.units} equal units")
        width = self.size // self.units
        if self.units % n == 0:
            per = self.units // n
            return range(r * per * width, (r + 1) * per * width)
        if replicate and n % self.units == 0:
            unit = r * self.units // n
            return range(unit * width, (unit + 1) * width)
        raise ShardError(
            f"{self.units} units of {width} features do not split over {n} ranks"
            + (" (nor replicate: ranks not a multiple of units)" if replicate else "")
        )


@dataclass(frozen=True)
class Run:
    """Features [whole, whole + length) of the whole parameter along the shard dim are its
    local features [local, local + length)."""

    whole: int
    local: int
    length: int


@dataclass(frozen=True)
class Shard:
    """Where a rank's parameter comes from in the whole one: runs along `dim`; local features
    no run covers are padding (zeros)."""

    dim: int
    whole_shape: tuple[int, ...]
    runs: tuple[Run, ...]

    @classmethod
    def replicated(cls, shape: tuple[int, ...]) -> Shard:
        return cls(0, shape, (Run(0, 0, shape[0]),))


class Sharded(nn.Module):
    """A layer whose parameters are shards of the whole layer's (`shards`, by name)."""

    def __init__(self, group: RankGroup) -> None:
        super().__init__()
        self.group = group
        self.shards: dict[str, Shard] = {}

    def whole_shape(self, name: str) -> tuple[int, ...]:
        """The whole layer's (the checkpoint's) shape of parameter `name`."""
        return self.shards[name].whole_shape

    @torch.no_grad()
    def load_shard(self, name: str, tensor: torch.Tensor, start: int = 0) -> None:
        """Copy this rank's part of `tensor` into parameter `name` (cast to its dtype);
        `tensor` holds rows [start, start + len) along dim 0 of the whole parameter (one
        member of a fused weight), or all of it (start 0). Padding is zeroed."""
        param: torch.Tensor = getattr(self, name)
        shard = self.shards[name]
        whole = shard.whole_shape
        if tensor.shape[1:] != whole[1:] or not 0 <= start <= whole[0] - tensor.shape[0]:
            raise ShardError(
                f"{name}: a tensor of {tuple(tensor.shape)} at row {start} is not part of "
                f"the whole {whole}"
            )
        if shard.dim != 0 and tensor.shape != whole:
            raise ShardError(f"{name}: split along dim {shard.dim}, it loads whole, not in rows")
        covered = 0
        for run in shard.runs:
            covered += run.length
            if shard.dim != 0:
                src = tensor.narrow(shard.dim, run.whole, run.length)
                param.narrow(shard.dim, run.local, run.length).copy_(src)
                continue
            lo = max(run.whole, start)
            hi = min(run.whole + run.length, start + tensor.shape[0])
            if lo < hi:
                dst = param.narrow(0, run.local + lo - run.whole, hi - lo)
                dst.copy_(tensor.narrow(0, lo - start, hi - lo))
        pad = param.shape[shard.dim] - covered
        if pad:
            param.narrow(shard.dim, covered, pad).zero_()

    def holds_index(self, name: str, index: int) -> bool:
        """Whether this rank holds row `index` along dim 0 of parameter `name` (load_index)."""
        shard = self.shards[name]
        return shard.dim == 0 and any(r.whole <= index < r.whole + r.length for r in shard.runs)

    @torch.no_grad()
    def load_index(
        self,
        name: str,
        tensor: torch.Tensor,
        index: int,
        part: tuple[int, int, int] | None = None,
    ) -> None:
        """Copy `tensor` into row `index` along dim 0 of the whole parameter `name` (one
        expert of a stack), or into `part` of it (dim, start, length: gate or up of a fused
        pair), if this rank holds that row (a run along dim 0 covers it); else nothing."""
        shard = self.shards[name]
        if shard.dim != 0 or not 0 <= index < shard.whole_shape[0]:
            raise ShardError(f"{name}: row {index} of the whole {shard.whole_shape} by dim 0")
        for run in shard.runs:
            if run.whole <= index < run.whole + run.length:
                dst = getattr(self, name).select(0, run.local + index - run.whole)
                if part is not None:
                    dst = dst.narrow(*part)
                dst.copy_(tensor)
                return


def _empty(*shape: int) -> nn.Parameter:
    """A parameter to be loaded (on the meta device inside the loader's `torch.device`)."""
    return nn.Parameter(torch.empty(shape), requires_grad=False)


class ColumnParallelLinear(Sharded):
    """y = x W^T + b with W's output features split: a rank's output is its own slice of
    each part, concatenated ([N, sum of the parts' local features])."""

    def __init__(
        self,
        in_features: int,
        parts: Sequence[Part],
        bias: bool,
        group: RankGroup,
        product: Product = F.linear,
        replicate: bool = False,
    ) -> None:
        """`parts`: the fused weight's members in order (one Part for a plain layer);
        `replicate`: a part with fewer units than ranks is replicated (KV heads)."""
        super().__init__(group)
        self.product = product
        runs, whole, local = [], 0, 0
        for part in parts:
            rows = part.rows(group, replicate)
            runs.append(Run(whole + rows.start, local, len(rows)))
            whole += part.size
            local += len(rows)
        self.in_features, self.out_features = in_features, local
        self.weight = _empty(local, in_features)  # [out / N, in]
        self.shards["weight"] = Shard(0, (whole, in_features), tuple(runs))
        self.bias = _empty(local) if bias else None
        if bias:
            self.shards["bias"] = Shard(0, (whole,), tuple(runs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out / N]
        return self.product(x, self.weight, self.bias)


class RowParallelLinear(Sharded):
    """y = x W^T + b with W's input features split: x arrives split the same way (a column-
    parallel layer's output), each rank's product is a partial sum, all-reduced, and the bias
    (whole on every rank) is added once, after the sum."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: RankGroup,
        units: int | None = None,
        product: Product = F.linear,
    ) -> None:
        """`units`: the input's blocks that are never cut (heads for o_proj; default: single
        features)."""
        super().__init__(group)
        self.product = product
        rows = Part(in_features, units or in_features).rows(group)
        self.in_features, self.out_features = len(rows), out_features
        self.weight = _empty(out_features, len(rows))  # [out, in / N]
        run = Run(rows.start, 0, len(rows))
        self.shards["weight"] = Shard(1, (out_features, in_features), (run,))
        self.bias = _empty(out_features) if bias else None
        if bias:
            self.shards["bias"] = Shard.replicated((out_features,))

    def forward(
        self,
        x: torch.Tensor,  # [N, in / N]
        product: Product | None = None,
    ) -> torch.Tensor:  # [N, out], the same on every rank
        """`product`: another weight product for this call (the MLP's fused SiLU-and-multiply
        down projection, whose input is the gate-up output)."""
        y = (product or self.product)(x, self.weight, None)
        y = self.group.all_reduce_sum(y)
        return y if self.bias is None else y.add_(self.bias)


def vocab_rows(vocab: int, group: RankGroup) -> tuple[int, int, int]:
    """(first id, ids held, rows a rank keeps): ceil(vocab / N) rows a rank, rank r's from
    r * that; the last ranks' rows past the vocab are padding."""
    per = -(-vocab // group.world_size)
    first = group.rank * per
    return first, max(0, min(per, vocab - first)), per


class VocabParallelEmbedding(Sharded):
    """nn.Embedding with the vocab rows split over the ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: RankGroup) -> None:
        super().__init__(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.first, self.held, per = vocab_rows(num_embeddings, group)
        self.weight = _empty(per, embedding_dim)  # [ceil(V / N), D]
        run = Run(self.first, 0, self.held)
        self.shards["weight"] = Shard(0, (num_embeddings, embedding_dim), (run,))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D]
        local = ids - self.first
        outside = (local < 0) | (local >= self.held)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0.0)  # exact zeros: the sum is one rank's row
        return self.group.all_reduce_sum(x)


class ParallelLMHead(Sharded):
    """nn.Linear(D, V, bias=False) with the vocab rows split like VocabParallelEmbedding's
    (the same shard when tied to it); every rank gets all the logits."""

    def __init__(self, embedding_dim: int, num_embeddings: int, group: RankGroup) -> None:
        super().__init__(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        first, held, per = vocab_rows(num_embeddings, group)
        self.weight = _empty(per, embedding_dim)  # [ceil(V / N), D]
        self.shards["weight"] = Shard(0, (num_embeddings, embedding_dim), (Run(first, 0, held),))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V]
        logits = self.group.all_gather_last_dim(F.linear(hidden, self.weight))  # [N, N * per]
        if logits.shape[-1] == self.num_embeddings:
            return logits
        return logits[..., : self.num_embeddings].contiguous()
