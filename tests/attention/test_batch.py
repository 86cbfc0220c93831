"""The Batch builder on a hand-made step: exact ids, positions, slots, offsets and page table."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.batch import BatchBuilder, SeqSpan

PS = 4


def ints(t: torch.Tensor) -> list:
    assert t.dtype == torch.int32
    return t.tolist()


def test_a_mixed_step_is_described_exactly():
    spans = [
        SeqSpan([101], 5, [7, 3], True),  # decode: position 5 is page 3, offset 1
        SeqSpan([102], 0, [9, 4], True),  # decode holding a page more than it needs
        SeqSpan([201, 202, 203], 4, [2, 5], True),  # prefill with context
        SeqSpan([301, 302, 303, 304, 305], 4, [11, 12, 6], False),  # crosses into page 6
    ]
    b = BatchBuilder(PS, num_pages=16, device=torch.device("cpu")).build(spans)
    assert ints(b.input_ids) == [101, 102, 201, 202, 203, 301, 302, 303, 304, 305]
    assert ints(b.positions) == [5, 0, 4, 5, 6, 4, 5, 6, 7, 8]
    assert ints(b.slot_mapping) == [13, 36, 20, 21, 22, 48, 49, 50, 51, 24]
    assert ints(b.query_start) == [0, 1, 2, 5, 10]
    assert ints(b.query_lens) == [1, 1, 3, 5]
    assert ints(b.kv_lens) == [6, 1, 7, 9]
    # each row: the pages its KV needs, in order, then page 0 as padding
    assert ints(b.page_table) == [[7, 3, 0], [9, 0, 0], [2, 5, 0], [11, 12, 6]]
    assert ints(b.sample_indices) == [0, 1, 4]  # the last token of each sampling sequence
    assert b.num_decodes == 2
    assert (b.num_seqs, b.num_tokens, b.num_samples, b.page_size) == (4, 10, 3, PS)
    assert b.host_query_start == (0, 1, 2, 5, 10)
    assert b.host_kv_lens == (6, 1, 7, 9)
    assert [b.host_query_len(i) for i in range(4)] == [1, 1, 3, 5]
    assert (b.max_query_len, b.max_kv_len) == (5, 9)


def test_only_leading_one_token_spans_are_decodes():
    spans = [
        SeqSpan([1], 3, [0], True),
        SeqSpan([2, 3], 0, [1], True),
        SeqSpan([4], 7, [2, 3], True),  # one token after a prefill: a chunk, not a decode
    ]
    b = BatchBuilder(PS, 16, torch.device("cpu")).build(spans)
    assert b.num_decodes == 1
    assert ints(b.positions) == [3, 0, 1, 7]
    assert ints(b.slot_mapping) == [3, 4, 5, 15]
    prefill_only = BatchBuilder(PS, 16, torch.device("cpu")).build(spans[1:2])
    assert prefill_only.num_decodes == 0
    assert ints(prefill_only.sample_indices) == [1]


def test_a_new_build_does_not_change_the_last_batch_on_cpu():
    builder = BatchBuilder(PS, 16, torch.device("cpu"))
    first = builder.build([SeqSpan([5, 6], 0, [1], True)])
    builder.build([SeqSpan([7, 8, 9], 0, [2], True)])
    assert ints(first.input_ids) == [5, 6]
    assert ints(first.slot_mapping) == [4, 5]


def test_refusals_say_what_is_wrong():
    builder = BatchBuilder(PS, 16, torch.device("cpu"))
    with pytest.raises(ValueError, match="needs 2 pages of 4 tokens, it holds 1"):
        builder.build([SeqSpan([1, 2], 3, [0], True)])
    with pytest.raises(ValueError, match="at least one sequence"):
        builder.build([])
    with pytest.raises(ValueError, match="past int32"):
        BatchBuilder(16, 2**27, torch.device("cpu"))
