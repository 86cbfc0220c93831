"""A data-parallel attention step (`--dp N`): the scheduler's chunks split by the rank that
attends each, and where each chunk's rows land once every rank's are gathered.

The pool is split in N parts (kvcache/allocator.py), part r being rank r's pool, and a request's
pages are all in one part: its rank, which alone runs its attention. Each rank builds its Batch
from its own chunks, in the step's order (decodes first, so each rank's Batch has the usual
layout), runs the forward on them (the MoE layers exchange tokens: parallel/dp_tokens.py), and
the final hidden states of every rank are gathered rank by rank, rank 0's rows first: the
leader samples and scores from those. `split` says, for each chunk in the step's order, which
rank holds it and its first row in that gathered tensor (`bases`); the leader's plan sends each
chunk's rank and its pages as that rank's pool numbers them (`local_pages`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.scheduler import Chunk
from pdserve.parallel.step_record import SeqPlan


@dataclass(frozen=True)
class DpSplit:
    ranks: list[int]  # each chunk's rank, in the step's order
    counts: list[int]  # tokens per rank
    bases: list[int]  # each chunk's first row in the gathered hidden states

    def of(self, chunks: Sequence[Chunk], rank: int) -> list[Chunk]:
        """`rank`'s chunks, in the step's order."""
        return [c for c, r in zip(chunks, self.ranks, strict=True) if r == rank]


def rank_of(chunk: Chunk) -> int:
    """The rank that attends `chunk`: the pool part its request's pages are in."""
    lease = chunk.request.lease
    if lease is None or lease.part is None:
        raise RuntimeError(f"request {chunk.request.request_id} runs without pages of a rank")
    return lease.part


def split(chunks: Sequence[Chunk], world: int) -> DpSplit:
    """The step's chunks over `world` ranks (each by `rank_of`)."""
    ranks = [rank_of(c) for c in chunks]
    counts = [0] * world
    for c, r in zip(chunks, ranks, strict=True):
        if not 0 <= r < world:
            raise RuntimeError(f"request {c.request.request_id} is on rank {r} of {world}")
        counts[r] += c.length
    first = [sum(counts[:r]) for r in range(world)]  # each rank's first gathered row
    bases = []
    for c, r in zip(chunks, ranks, strict=True):
        bases.append(first[r])
        first[r] += c.length
    return DpSplit(ranks, counts, bases)


def sample_rows(chunks: Sequence[Chunk], bases: Sequence[int]) -> list[int]:
    """The gathered rows whose logits are sampled: each sampling chunk's last, in step order."""
    return [b + c.length - 1 for c, b in zip(chunks, bases, strict=True) if c.samples]


def local_pages(plan: Sequence[SeqPlan], ranks: Sequence[int], part_pages: int) -> list[SeqPlan]:
    """The plan's sequences with their ranks, each page numbered as its rank's pool does;
    RuntimeError for a page outside its rank's pool (a lease that broke its part)."""
    out = []
    for s, r in zip(plan, ranks, strict=True):
        pages = [p - r * part_pages for p in s.pages]
        if pages and not 0 <= min(pages) <= max(pages) < part_pages:
            raise RuntimeError(f"pages {list(s.pages)} are not all in rank {r}'s pool")
        out.append(SeqPlan(s.token_ids, s.start, pages, s.samples, r))
    return out


def rank_counts(seqs: Sequence[SeqPlan], world: int) -> list[int]:
    """A follower's view of a step's token counts per rank, from the leader's plan."""
    counts = [0] * world
    for s in seqs:
        if not 0 <= s.rank < world:
            raise ValueError(f"a sequence of rank {s.rank} in a group of {world}")
        counts[s.rank] += len(s.token_ids)
    return counts
