"""The step record's one wire form (parallel/step_record.py): what the leader encodes a follower
decodes, field for field; a record that breaks anywhere is refused whole; the digest sees any
change of the plan. No processes: the codec is pure."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.parallel.step_record import (
    Kind,
    PoolPlan,
    RecordError,
    SeqPlan,
    StepRecord,
    decode,
    digest,
    encode,
)

FORWARD = StepRecord(
    Kind.FORWARD,
    7,
    [
        SeqPlan([42], 33, [3, 9, 4], True),  # a decode
        SeqPlan(list(range(100, 124)), 16, [5, 6, 8], False),  # a chunk that does not sample
        SeqPlan([1, 2, 3], 0, [11], True, rank=1),  # data-parallel attention: rank 1's
    ],
    [1, 2, 3, 30, 31],
)


@pytest.mark.parametrize(
    "record",
    [
        FORWARD,
        StepRecord(Kind.SETUP, 1, pool=PoolPlan(4096, 16)),
        StepRecord(Kind.SETUP, 1, pool=PoolPlan(64, 4, shared=True)),
        StepRecord(Kind.IDLE, 2),
        StepRecord(Kind.SHUTDOWN, 3),
        StepRecord(Kind.FORWARD, 4, [SeqPlan([5], 0, [1], True)]),
    ],
)
def test_what_the_leader_encodes_a_follower_decodes(record):
    words = encode(record)
    assert words.dtype == np.int64
    back = decode(words)
    assert (back.kind, back.step, back.pool) == (record.kind, record.step, record.pool)
    assert list(back.score_rows) == list(record.score_rows)
    assert [(list(s.token_ids), s.start, list(s.pages), s.samples, s.rank) for s in back.seqs] == [
        (list(s.token_ids), s.start, list(s.pages), s.samples, s.rank) for s in record.seqs
    ]
    assert np.array_equal(encode(back), words)  # what a follower digests is the leader's


def test_the_digest_sees_any_change_of_the_plan():
    base = digest(encode(FORWARD))
    assert digest(encode(decode(encode(FORWARD)))) == base
    seqs = list(FORWARD.seqs)
    changes = [
        StepRecord(Kind.FORWARD, 8, seqs, FORWARD.score_rows),  # the step
        StepRecord(Kind.FORWARD, 7, seqs, [1, 2, 3, 30]),  # one row fewer to score
        StepRecord(
            Kind.FORWARD, 7, [SeqPlan([43], 33, [3, 9, 4], True), *seqs[1:]], FORWARD.score_rows
        ),  # a token  # fmt: skip
        StepRecord(
            Kind.FORWARD, 7, [SeqPlan([42], 33, [3, 9, 5], True), *seqs[1:]], FORWARD.score_rows
        ),  # a page  # fmt: skip
        StepRecord(
            Kind.FORWARD, 7, [SeqPlan([42], 33, [3, 9, 4], False), *seqs[1:]], FORWARD.score_rows
        ),  # whether it samples  # fmt: skip
        StepRecord(Kind.FORWARD, 7, seqs[::-1], FORWARD.score_rows),  # the order
        StepRecord(
            Kind.FORWARD, 7, [*seqs[:2], SeqPlan([1, 2, 3], 0, [11], True)], FORWARD.score_rows
        ),  # the rank that attends it  # fmt: skip
    ]
    assert len({digest(encode(r)) for r in changes} | {base}) == len(changes) + 1


def test_a_broken_record_is_refused_whole():
    words = encode(FORWARD)
    cases = {
        "shorter than a record's head": words[:3],
        "record version 1": np.concatenate([[1], words[1:]]),
        "unknown record kind 9": np.concatenate([words[:1], [9], words[2:]]),
        "is cut off": words[:8],
        "do not end the record": words[:-1],
        "do not end the record's": np.concatenate([words, [0]]),
    }
    for why, bad in cases.items():
        with pytest.raises(RecordError, match=why):
            decode(np.asarray(bad, dtype=np.int64))


def test_a_record_says_only_what_its_kind_means():
    with pytest.raises(RecordError, match="SETUP records need a pool"):
        StepRecord(Kind.SETUP, 1)
    with pytest.raises(RecordError, match="FORWARD records carry no pool"):
        StepRecord(Kind.FORWARD, 1, pool=PoolPlan(1, 16))
    with pytest.raises(RecordError, match="IDLE records run no sequences"):
        StepRecord(Kind.IDLE, 1, [SeqPlan([1], 0, [1], True)])
    # decoded too: a SETUP without its pool is refused, naming the step
    words = encode(StepRecord(Kind.SETUP, 5, pool=PoolPlan(8, 16)))
    words[3] = 0  # "has a pool"
    with pytest.raises(RecordError, match="step 5: SETUP records need a pool"):
        decode(words)
