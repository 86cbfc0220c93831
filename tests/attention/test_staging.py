"""The staged upload: many small tensors packed into one buffer, one copy, views back."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.staging import ALIGN, MIN_CAPACITY, Staging


def test_parts_come_back_in_shape_and_value_from_one_buffer():
    st = Staging(torch.device("cpu"))
    parts = [
        torch.arange(5),  # int64 in, int32 out
        torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),
        torch.empty(0, dtype=torch.long),
        torch.tensor([-7]),
    ]
    views = st.upload(parts)
    assert [v.shape for v in views] == [p.shape for p in parts]
    for v, p in zip(views, parts, strict=True):
        assert v.dtype == torch.int32
        assert v.tolist() == p.tolist()
    base = views[0].untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in views)  # one buffer
    offsets = [v.storage_offset() for v in views]
    assert offsets == [0, ALIGN, 2 * ALIGN, 2 * ALIGN]
    assert all(o % ALIGN == 0 for o in offsets)


def test_the_buffer_grows_and_old_views_keep_their_values():
    st = Staging(torch.device("cpu"))
    small = st.upload([torch.tensor([1, 2, 3])])[0]
    assert st.capacity == MIN_CAPACITY
    big = torch.arange(3 * MIN_CAPACITY)
    (got,) = st.upload([big, torch.tensor([9])])[:1]
    assert st.capacity == 4 * MIN_CAPACITY  # doubled until it fits (plus alignment)
    assert torch.equal(got, big.int())
    assert small.tolist() == [1, 2, 3]  # on the CPU an upload is a copy: no aliasing


def test_uploads_work_in_and_out_of_inference_mode():
    st = Staging(torch.device("cpu"))
    with torch.inference_mode():  # the runner's forward grows the buffers first
        assert st.upload([torch.tensor([1, 2])])[0].tolist() == [1, 2]
    assert st.upload([torch.tensor([3])])[0].tolist() == [3]  # a Batch built by hand
    with torch.inference_mode():
        assert st.upload([torch.tensor([4, 5, 6])])[0].tolist() == [4, 5, 6]


def test_lists_are_written_straight_in_and_must_fit():
    st = Staging(torch.device("cpu"))
    table = torch.tensor([[3, 1], [4, 0]])
    ids, empty, tab = st.upload([[7, 8, 9], [], table])
    assert (ids.tolist(), ids.dtype, empty.shape, tab.tolist()) == (
        [7, 8, 9],
        torch.int32,
        (0,),
        [[3, 1], [4, 0]],
    )
    with pytest.raises(OverflowError):
        st.upload([[2**31]])
