"""D's stager: KV frames checked and staged off the control thread, every message kept in order."""

from __future__ import annotations

import gc

import pytest
import torch

from pdserve.protocol.messages import FirstToken, KVChunk, PrefillDone
from pdserve.runtime.supervisor import Supervisor
from pdserve.transfer import stager as stager_mod
from pdserve.transfer.bulk import Bulk
from pdserve.transfer.control import Inbound
from pdserve.transfer.frame_workers import FrameWorkers
from pdserve.transfer.stager import StagedChunk, Stager

PAGE = 4096


def chunk(room: int, pages: list[int], fill: int = 1) -> Inbound:
    sealed = Bulk.seal([bytes([fill + i]) * PAGE for i in range(len(pages))])
    bulk = Bulk.received([bytes(f) for f in sealed.frames()], sealed.digests)
    return Inbound("p0", KVChunk(room=room, epoch=1, dst_pages=pages), bulk)


def done(room: int) -> Inbound:
    return Inbound("p0", PrefillDone(room=room, epoch=1, first_token=3))


def kinds(got: list[object]) -> list[str]:
    return [type(getattr(x, "msg", x)).__name__ + ("!" if getattr(x, "refused", "") else "")
            for x in got]  # fmt: skip


def test_messages_keep_their_order_behind_the_chunks_being_staged():
    got: list[object] = []
    s = Stager(got.append, PAGE, pin=False)
    s.put(done(1))  # nothing queued: straight to the engine
    assert kinds(got) == ["PrefillDone"]
    s.put(chunk(2, [4, 5]))
    s.put(done(2))  # behind the chunk, though it needs no work
    assert kinds(got) == ["PrefillDone"]
    s.tick()
    s.tick()
    assert kinds(got) == ["PrefillDone", "KVChunk", "PrefillDone"]
    staged = got[1]
    assert isinstance(staged, StagedChunk) and staged.rows is not None
    assert staged.rows.shape == (2, PAGE) and staged.rows[1].eq(2).all()
    assert (s.staged, s.refused) == (1, 0)
    s.put(done(3))
    assert len(got) == 4  # nothing queued again: straight through
    s.tick()  # an empty queue: returns after its bounded wait


def test_a_first_token_goes_ahead_of_the_chunks_being_staged():
    """FirstToken asks for no order: the client's first token does not wait for KV frames."""
    got: list[object] = []
    s = Stager(got.append, PAGE, pin=False)
    s.put(chunk(2, [4, 5]))
    s.put(Inbound("p0", FirstToken(room=2, epoch=1, token=3)))
    s.put(done(2))
    assert kinds(got) == ["FirstToken"] and s.snapshot()["waiting"] == 2
    s.tick()
    s.tick()
    assert kinds(got) == ["FirstToken", "KVChunk", "PrefillDone"]


def test_frames_are_checked_on_the_workers():
    workers = FrameWorkers(2)
    sup = Supervisor()
    for i in range(2):
        sup.spawn(f"frames-{i}", workers.tick)
    try:
        got: list[object] = []
        s = Stager(got.append, PAGE, pin=False, workers=workers)
        s.put(chunk(2, list(range(16)), fill=7))
        s.tick()
        (staged,) = got
        assert isinstance(staged, StagedChunk) and staged.rows is not None
        expected = torch.arange(7, 23, dtype=torch.uint8)[:, None].expand(16, PAGE)
        assert torch.equal(staged.rows, expected)
    finally:
        assert sup.stop() == []


def test_past_its_bound_a_chunk_is_refused_unread(monkeypatch):
    """What D holds in transit counts queued frames and staged rows until the engine frees them;
    a chunk that would take it past the bound, or one larger than P ever sends, is refused and
    its frames let go at once."""
    monkeypatch.setattr(stager_mod, "STAGE_MAX_BYTES", 3 * PAGE)
    monkeypatch.setattr(stager_mod, "MAX_CHUNK_BYTES", 2 * PAGE)
    got: list[object] = []
    s = Stager(got.append, PAGE, pin=False)
    s.put(chunk(1, [0, 1]))
    assert s.snapshot()["held_bytes"] == 2 * PAGE
    s.put(chunk(2, [2, 3]))  # would hold 4 pages: refused
    s.put(chunk(3, [4, 5, 6]))  # larger than any chunk P sends: refused
    s.put(done(2))
    assert s.snapshot()["held_bytes"] == 2 * PAGE  # the refused ones' frames are not held
    for _ in range(4):
        s.tick()
    assert kinds(got) == ["KVChunk", "KVChunk!", "KVChunk!", "PrefillDone"]
    assert "holds 8192 bytes of KV in transit" in got[1].refused  # type: ignore[attr-defined]
    assert "a KV chunk of 12288 bytes" in got[2].refused  # type: ignore[attr-defined]
    assert s.snapshot()["held_bytes"] == 2 * PAGE  # the staged rows, until the engine lets them go
    s.put(chunk(4, [7]))
    s.put(chunk(5, [8]))  # 4 pages again: refused
    s.tick()
    s.tick()
    assert kinds(got)[-2:] == ["KVChunk", "KVChunk!"]
    got.clear()  # the engine wrote them and dropped them
    gc.collect()
    assert s.snapshot()["held_bytes"] == 0 and s._waiting == 0
    s.put(chunk(6, [9, 10]))  # taken again
    s.tick()
    assert kinds(got) == ["KVChunk"] and (s.staged, s.refused) == (3, 3)


def test_a_chunk_that_cannot_be_staged_fails_itself_not_the_thread():
    got: list[object] = []

    class Broken(FrameWorkers):
        def map(self, fn, n):  # type: ignore[no-untyped-def, override]
            raise TimeoutError("a frame worker held an item for over 10.0 s")

    s = Stager(got.append, PAGE, pin=False, workers=Broken(1))
    s.put(chunk(1, [0]))
    s.put(done(1))
    s.tick()  # raises nothing
    s.tick()
    assert kinds(got) == ["KVChunk!", "PrefillDone"]
    assert "TimeoutError: a frame worker held" in got[0].refused  # type: ignore[attr-defined]


@pytest.mark.parametrize("pages", [[], [9]])
def test_a_chunk_without_frames(pages):
    got: list[object] = []
    s = Stager(got.append, PAGE, pin=False)
    s.put(Inbound("p0", KVChunk(room=1, epoch=1, dst_pages=pages)))
    s.tick()
    (staged,) = got
    assert isinstance(staged, StagedChunk)
    if pages:
        assert staged.rows is None and "0 frames for 1 pages" in staged.refused
    else:
        assert staged.rows is not None and staged.rows.shape == (0, PAGE) and not staged.refused
