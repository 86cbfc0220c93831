"""The step record: everything a follower rank needs to run the leader's step, as plain integers.

A tensor-parallel engine is one scheduler (rank 0's, the leader's) and N model shards. Every
forward is a chain of collectives (each row-parallel layer's all-reduce, the LM head's
all-gather), so every rank must run the same forward with the same shapes in the same order.
A follower therefore decides nothing: each step the leader sends one `StepRecord` and the
follower does exactly what it says (LESSONS #12). What gates a collective travels in it:

  * `kind`: SETUP (once, first: the pool the leader's sizing chose), FORWARD, IDLE (nothing to
    run: a keepalive, so that a follower waiting for the next record never waits past the
    collective timeout while the leader has no work, LESSONS #21), SHUTDOWN.
  * `step`: the leader's count of records, 1, 2, ...; a follower checks it is the next one.
  * `seqs`: each sequence of the step as plain data: the token ids of its span, its start
    (tokens already in its pages), its pages (as many as start + span needs), whether its last
    row samples, and its rank: with data-parallel attention (`--dp`) the rank whose pool holds
    its pages, which alone attends it (its page ids are that pool's); else 0, and every rank
    runs it. In the leader's order (decodes first), so a follower's `BatchBuilder.build` makes
    the same Batch, bit for bit, as the leader's runner did from its Requests.
  * `score_rows`: the rows of the step's hidden states whose prompt logprobs the leader
    scores; scoring runs the LM head (a collective) on them, PROMPT_LOGPROB_ROWS at a time,
    and which rows are still unscored is the leader's Request state, not the follower's.

Why plain spans rather than the leader's packed Batch buffer: the buffer is built on the leader's
device, with persistent page-table rows (attention/page_table.py) and, with overlapped
scheduling, input ids filled on the device after the upload; spans are host data the leader
already has, and a follower given them builds its Batch with its own builder, each row for
that build only (`SeqSpan.owner` None), so it keeps no state per request at all: nothing to
release, nothing to drift. The cost is each sequence's page list every step (a decode's whole
page table), which an incremental form keyed by request id could cut later. A step's input
ids are all on the host: a tensor-parallel engine runs without overlapped scheduling.

One wire form (STYLE 14): a flat int64 array, `encode` and `decode` its only writer and
reader; `digest` is the CRC-32 of the encoded array. Pure: no torch.distributed here
(parallel/lockstep.py moves the words).
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

VERSION = 2
_HEAD = 7  # version, kind, step, a pool (0 none, 1, 2 shared), num_pages, page_size, sequences
_SEQ_HEAD = 5  # start, tokens, pages, samples, rank


class RecordError(ValueError):
    """Words that are not a step record of this version: the message says where they break."""


class Kind(enum.IntEnum):
    SETUP = 1
    FORWARD = 2
    IDLE = 3
    SHUTDOWN = 4


@dataclass(frozen=True)
class SeqPlan:
    """One sequence's share of a step (attention/batch.py SeqSpan, without an owner)."""

    token_ids: Sequence[int]  # the span's tokens, computed at positions start, start + 1, ...
    start: int  # tokens already in its pages
    pages: Sequence[int]  # its pages in token order, exactly those start + span needs
    samples: bool  # its last token's logits are wanted
    rank: int = 0  # data-parallel attention: the rank that attends it, in whose pool `pages` are


@dataclass(frozen=True)
class PoolPlan:
    """The KV pool every rank builds (SETUP): the leader's sizing decides it for all."""

    num_pages: int
    page_size: int
    # In shared memory, so that the leader can read and write every rank's pages: a worker
    # of a PD role moves whole pages assembled from its ranks' (kvcache/rank_pages.py).
    shared: bool = False


@dataclass(frozen=True)
class StepRecord:
    kind: Kind
    step: int
    seqs: Sequence[SeqPlan] = ()
    score_rows: Sequence[int] = ()  # hidden rows whose prompt logprobs are scored
    pool: PoolPlan | None = None  # SETUP only

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def __post_init__(self) -> None:
        if (self.kind is Kind.SETUP) != (self.pool is not None):
            need = "need a pool" if self.pool is None else "carry no pool"
            raise RecordError(f"{self.kind.name} records {need}")
        if self.kind is not Kind.FORWARD and (self.seqs or self.score_rows):
            raise RecordError(f"{self.kind.name} records run no sequences")


def encode(record: StepRecord) -> np.ndarray:
    """The record as int64 words: a head, each sequence (its head, tokens, pages), the rows."""
    pool = record.pool
    words: list[int] = [
        VERSION,
        int(record.kind),
        record.step,
        0 if pool is None else 2 if pool.shared else 1,
        pool.num_pages if pool is not None else 0,
        pool.page_size if pool is not None else 0,
        len(record.seqs),
    ]
    for s in record.seqs:
        words += (s.start, len(s.token_ids), len(s.pages), int(s.samples), s.rank)
        words += s.token_ids
        words += s.pages
    words.append(len(record.score_rows))
    words += record.score_rows
    return np.array(words, dtype=np.int64)


def decode(array: np.ndarray) -> StepRecord:
    """The record `encode` wrote; RecordError for anything else (never a partial record)."""
    words: list[int] = array.tolist()
    n = len(words)
    if n < _HEAD + 1:
        raise RecordError(f"{n} words are shorter than a record's head")
    version, kind_word, step, has_pool, num_pages, page_size, num_seqs = words[:_HEAD]
    if version != VERSION:
        raise RecordError(f"record version {version}, this rank reads {VERSION}")
    try:
        kind = Kind(kind_word)
    except ValueError:
        raise RecordError(f"unknown record kind {kind_word}") from None
    if num_seqs < 0 or step < 1 or has_pool not in (0, 1, 2):
        raise RecordError(f"a record head of {num_seqs} sequences, step {step}, pool {has_pool}")
    at = _HEAD
    seqs: list[SeqPlan] = []
    for i in range(num_seqs):
        if at + _SEQ_HEAD > n:
            raise RecordError(f"sequence {i} of {num_seqs} is cut off at word {at}")
        start, ntok, npages, samples, rank = words[at : at + _SEQ_HEAD]
        at += _SEQ_HEAD
        if min(start, ntok, npages, rank) < 0 or samples not in (0, 1) or at + ntok + npages > n:
            raise RecordError(
                f"sequence {i}: start {start}, {ntok} tokens, {npages} pages, rank {rank}"
            )
        seqs.append(SeqPlan(words[at : at + ntok], start, words[at + ntok : at + ntok + npages],
                            bool(samples), rank))  # fmt: skip
        at += ntok + npages
    if at >= n or words[at] != n - at - 1:
        raise RecordError(f"the score rows at word {at} do not end the record's {n} words")
    pool = PoolPlan(num_pages, page_size, has_pool == 2) if has_pool else None
    try:
        return StepRecord(kind, step, seqs, words[at + 1 :], pool)
    except RecordError as e:
        raise RecordError(f"step {step}: {e}") from None


def digest(words: np.ndarray) -> int:
    """The CRC-32 of encoded words: what every rank compares before a step's collectives."""
    return zlib.crc32(np.ascontiguousarray(words, dtype=np.int64).tobytes())
