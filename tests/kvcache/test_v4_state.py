"""DeepSeek-V4's KV layout (compressed rows, per-request state) and its state slots: the layout's
geometry and handshake, the state pool, and a slot living and dying with its lease."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pdserve.attention.batch import BatchBuilder, Decodes, SeqSpan
from pdserve.attention.v4_kv import Journal, PoolStepKV, undo
from pdserve.kvcache.allocator import PageAllocator
from pdserve.kvcache.buffer_spec import BufferSpec, StateSpec
from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.lease import LeaseError, Leases
from pdserve.kvcache.pool import KVPool, pages_for_budget
from pdserve.kvcache.state_pool import SlotError, StatePool, pages_per_slot, slot_regions
from pdserve.kvcache.v4_layout import (
    CSA,
    CSA_KV,
    CSA_OVERLAP_GATE,
    HCA,
    HCA_KV,
    HCA_TAIL_KV,
    SWA,
    SWA_RING,
    v4_buffers,
    v4_page_size,
    v4_state,
)
from pdserve.model.deepseek_v4.kv import LocalSeqKV


@dataclass(frozen=True)
class Shape:
    num_layers: int = 4
    layer_types: tuple[str, ...] = (SWA, CSA, HCA, CSA)
    head_dim: int = 64
    index_head_dim: int = 32
    sliding_window: int = 16
    csa_ratio: int = 4
    hca_ratio: int = 128


def layout(dtype: str = "float32", page_size: int = 16) -> KVLayout:
    s = Shape()
    size = v4_page_size(s, page_size)
    return KVLayout(v4_buffers(s, dtype, size), size, s.num_layers, state=v4_state(s, dtype))


def test_pages_hold_whole_windows_and_rows_per_entry() -> None:
    lay = layout()
    assert lay.page_size == 128  # 16 asked: the HCA window is 128 tokens
    assert v4_page_size(Shape(), 256) == 256
    rows = {(r.layer, r.spec.name): r.nbytes for r in lay.regions}
    assert rows[(1, CSA_KV)] == 32 * 64 * 4  # 128 tokens / 4 per row, 64 float32 each
    assert rows[(2, HCA_KV)] == 1 * 64 * 4  # one HCA entry per page
    assert (0, CSA_KV) not in rows  # a sliding-only layer pages nothing
    with pytest.raises(ValueError, match="not a whole number of rows of 128 tokens"):
        KVLayout(v4_buffers(Shape(), "float32", 128)[:3], 64, 4)


def test_state_components_and_their_dtypes() -> None:
    st = {s.name: s for s in v4_state(Shape(), "bfloat16")}
    assert st[SWA_RING].shape == (16, 64) and st[SWA_RING].layers == (0, 1, 2, 3)
    assert st[HCA_TAIL_KV].shape == (127, 64) and st[HCA_TAIL_KV].layers == (2,)
    assert st[CSA_OVERLAP_GATE].dtype == "float32"  # the gate after its float32 bias
    assert st[SWA_RING].dtype == "bfloat16"


def test_the_handshake_names_a_state_component_and_round_trips() -> None:
    ours = layout()
    assert KVLayout.from_desc(ours.to_desc()) == ours
    assert ours.mismatch(KVLayout.from_dict(ours.to_dict())) is None
    other = KVLayout(ours.buffers, ours.page_size, ours.num_layers, state=v4_state(
        Shape(sliding_window=32), "float32"
    ))  # fmt: skip
    assert ours.mismatch(other) == "state 'swa.ring' shape: (16, 64) vs (32, 64)"
    fewer = KVLayout(ours.buffers, ours.page_size, ours.num_layers, state=ours.state[:-1])
    assert ours.mismatch(fewer) == "state 'hca.tail_gate' missing on theirs"
    rows = tuple(
        BufferSpec(b.name, b.shape, b.dtype, b.layers, 8 if b.name == CSA_KV else b.tokens_per_row)
        for b in ours.buffers
    )
    assert ours.mismatch(KVLayout(rows, 128, 4, state=ours.state)) == (
        "buffer 'csa.kv' tokens_per_row: 4 vs 8"
    )
    with pytest.raises(ValueError, match="names layer 7"):
        KVLayout(ours.buffers, 128, 4, state=(StateSpec("x", (1,), "float32", (7,)),))


def state_pool(slots: int = 2) -> StatePool:
    pool = KVPool(layout(), 3, torch.device("cpu"), state_slots=slots)
    assert pool.state is not None
    return pool.state


def test_state_pool_slots_are_checked() -> None:
    sp = state_pool()
    assert sp.view(0, SWA_RING).shape == (2, 16, 64)
    with pytest.raises(KeyError, match="layer 0 has no state component 'hca.tail_kv'"):
        sp.view(0, HCA_TAIL_KV)
    a, b = sp.take(), sp.take()
    assert (a, b) == (0, 1) and sp.num_free == 0
    with pytest.raises(SlotError, match="all 2 state slots are taken"):
        sp.take()
    sp.give_back(a)
    with pytest.raises(SlotError, match="not taken"):
        sp.give_back(a)
    assert sp.violations([b]) == []
    assert sp.violations([]) == ["state slots taken but held by no lease: [1]"]


def test_slots_are_whole_pages_after_the_kv_pages() -> None:
    lay = layout()
    pool = KVPool(lay, 3, torch.device("cpu"), state_slots=2)
    sp = pool.state
    assert sp is not None
    each = pages_per_slot(lay.state, lay.page_bytes)
    assert pool.data.shape[0] == 3 + 2 * each and sp.first_page(1) == 3 + each
    sp.view(2, HCA_TAIL_KV)[1].fill_(1.5)  # slot 1's bytes are pool pages, nothing else's
    touched = (pool.data != 0).any(dim=1).nonzero().flatten().tolist()
    assert set(touched) <= set(range(sp.first_page(1), sp.first_page(1) + each))
    regions, used = slot_regions(lay.state)
    assert all(r.offset % 64 == 0 for r in regions) and used <= each * lay.page_bytes


def test_a_slot_lives_and_dies_with_its_lease() -> None:
    sp = state_pool()
    ls = Leases(PageAllocator(4), sp)
    a = ls.open("a", 1)
    assert a.take_slot() == 0 and a.slot == 0
    with pytest.raises(LeaseError, match="holds state slot 0 already"):
        a.take_slot()
    heir = a.hand_over("room")
    assert heir.slot == 0 and a.slot is None and ls.violations() == []
    heir.release()
    assert sp.num_free == 2 and ls.violations() == []
    with pytest.raises(LeaseError, match="keeps no per-request state"):
        Leases(PageAllocator(1)).open("b").take_slot()


def test_the_budget_pays_for_the_state_first() -> None:
    lay = layout()
    slot = pages_per_slot(lay.state, lay.page_bytes) * lay.page_bytes
    assert pages_for_budget(lay, 10 * lay.page_bytes + 3 * slot, 3) == 10
    assert pages_for_budget(lay, 2 * slot, 3) == 0


def test_pool_entries_round_trip_across_pages_like_local() -> None:
    lay = layout()
    pool = KVPool(lay, 6, torch.device("cpu"), state_slots=2)
    builder = BatchBuilder(lay.page_size, pool.num_pages, pool.device)
    # 300 tokens on pages [4, 1, 3] (entries cross pages), then 20 tokens on page [5].
    batch = builder.build_step(
        Decodes([], [], [], [], []),
        [SeqSpan(list(range(300)), 0, [4, 1, 3], True), SeqSpan([1] * 20, 0, [5], True)],
        state_slots=[1, 0],
    )
    journal: Journal = []
    step = PoolStepKV(pool, batch, journal)
    assert list(step.spans) == [(0, 300, 0, False), (300, 20, 0, False)]
    seq = step.seq(1, 0)
    local = LocalSeqKV({b.name: b for b in lay.buffers}, {s.name: s for s in lay.state}).view(1)
    values = torch.randn(75, 64)
    for first, n in ((0, 30), (30, 45)):
        seq.store_rows(CSA_KV, first, values[first : first + n])
        local.store_rows(CSA_KV, first, values[first : first + n])
    assert torch.equal(seq.rows(CSA_KV, 75), local.rows(CSA_KV, 75))
    assert torch.equal(pool.view(1, CSA_KV)[1, 0], values[32])  # page 1 holds entries 32..63
    assert not journal  # entries are rewritten as they were: no journal
    # The short sequence holds one page, 32 entries: none past it, whatever the table's width.
    short = step.seq(1, 1)
    with pytest.raises(ValueError, match="past the sequence's pages"):
        short.store_rows(CSA_KV, 32, values[:1])
    with pytest.raises(ValueError, match="past the sequence's pages"):
        short.rows(CSA_KV, 33)


def test_state_writes_are_journaled_and_undone() -> None:
    lay = layout()
    pool = KVPool(lay, 2, torch.device("cpu"), state_slots=2)
    assert pool.state is not None
    builder = BatchBuilder(lay.page_size, pool.num_pages, pool.device)
    batch = builder.build_step(
        Decodes([], [], [], [], []), [SeqSpan([1] * 5, 0, [0], True)], state_slots=[1]
    )
    pool.state.view(1, SWA_RING)[1].fill_(3.0)
    before = pool.data.clone()
    journal: Journal = []
    seq = PoolStepKV(pool, batch, journal).seq(1, 0)
    seq.write_state(SWA_RING, torch.tensor([2, 3]), torch.ones(2, 64))
    seq.write_state(SWA_RING, slice(3, 5), torch.full((2, 64), 5.0))  # row 3 written twice
    assert bool((pool.state.view(1, SWA_RING)[1, 3] == 5).all()) and len(journal) == 2
    undo(journal)
    assert torch.equal(pool.data, before) and journal == []
