"""Data-plane conformance on both backends: scattered page lists land byte-exact, for every
layout (the Llama family per dtype; typed buffers of several dtypes, fp8 among them). On tcp
the pages go P's writer -> (the wire: its bulk frames as bytes) -> D's stager -> D's receiver."""

from __future__ import annotations

import pytest
import torch

from pdserve.kvcache.pool import KVPool
from pdserve.kvcache.rank_pages import RankPages
from pdserve.protocol.messages import KVChunk, Msg
from pdserve.transfer import control_limits
from pdserve.transfer.bulk import Bulk
from pdserve.transfer.control import Inbound
from pdserve.transfer.dataplane import ShmWriter, TcpWriter
from pdserve.transfer.receiver import TcpReceiver
from pdserve.transfer.stager import StagedChunk, Stager
from tests.kvcache.layouts import NAMES, dsa, fill_random, layout

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


class CapturingControl:
    """Stands in for the control plane's send queue (the socket itself is tested elsewhere)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Msg, Bulk | None]] = []

    def send(self, peer: str, msg: Msg, bulk: Bulk | None = None) -> None:
        self.sent.append((peer, msg, bulk))


def wire(bulk: Bulk | None) -> Bulk | None:
    """What D's control thread hands on: the frames' bytes as received, their digests unchecked."""
    if bulk is None:
        return None
    return Bulk.received([bytes(f) for f in bulk.frames()], bulk.digests)


def stage(msg: KVChunk, bulk: Bulk | None, page_bytes: int, pin: bool = False) -> StagedChunk:
    """D's stager on one chunk, on this thread."""
    got: list[object] = []
    stager = Stager(got.append, page_bytes, pin)
    stager.put(Inbound("p0", msg, bulk))
    stager.tick()
    (staged,) = got
    assert isinstance(staged, StagedChunk)
    return staged


def receive(dst: KVPool, msg: KVChunk, bulk: Bulk | None) -> int:
    """D's side of tcp: stage the chunk, then write it into the pool (the engine's part)."""
    staged = stage(msg, wire(bulk), dst.layout.page_bytes, pin=dst.data.is_cuda)
    assert not staged.refused, staged.refused
    return TcpReceiver(RankPages.of(dst)).accept_rows(5, 2, msg.dst_pages, staged.rows)


def pools(name: str, shared: bool, src_device: str = "cpu") -> tuple[KVPool, KVPool]:
    lay = layout(name)
    src = KVPool(lay, 10, torch.device(src_device))
    fill_random(src, seed=len(name))
    dst = KVPool(lay, 12, torch.device("cpu"), shared=shared)
    return src, dst


def assert_landed(src: KVPool, dst: KVPool) -> None:
    """Each destination page holds its source page's bytes; every other page is untouched."""
    for s, d in zip(SRC, DST, strict=True):
        assert torch.equal(dst.page(d), src.page(s).cpu())
    untouched = [p for p in range(dst.num_pages) if p not in DST]
    assert not dst.data[untouched].any()
    if "index_k" in {b.name for b in dst.layout.buffers}:  # typed reads agree, bit for bit
        got = dst.view(2, "index_k")[DST[0]].view(torch.uint8)
        assert torch.equal(got, src.view(2, "index_k")[SRC[0]].cpu().view(torch.uint8))


SRC, DST = [7, 0, 3, 9], [11, 2, 5, 0]  # scattered, out of order, page 0 included


def shm_round_trip(src: KVPool, dst: KVPool) -> None:
    try:
        assert dst.shm is not None
        writer = ShmWriter([dst.shm], dst.layout, dst.num_pages)
        done = writer.write(1, 1, RankPages.of(src), SRC, DST, deadline=0.0)
        assert done.poll(), "shm completes inside write()"
        assert done.nbytes == len(SRC) * src.layout.page_bytes
        assert_landed(src, dst)
    finally:
        dst.close()


def tcp_round_trip(src: KVPool, dst: KVPool) -> None:
    ctl = CapturingControl()
    sent = TcpWriter(ctl, "d0", "p0").write(5, 2, RankPages.of(src), SRC, DST, 0.0)  # type: ignore[arg-type]
    assert sent.poll() and sent.nbytes == len(SRC) * src.layout.page_bytes
    ((peer, msg, bulk),) = ctl.sent
    assert peer == "d0" and isinstance(msg, KVChunk) and msg.dst_pages == DST
    assert (msg.room, msg.epoch) == (5, 2)
    assert bulk is not None and bulk.sizes == [src.layout.page_bytes] * len(SRC)  # one a page
    assert receive(dst, msg, bulk) == sent.nbytes
    assert_landed(src, dst)


@pytest.mark.parametrize("name", NAMES)
def test_shm_writes_scattered_pages_exactly(name):
    shm_round_trip(*pools(name, shared=True))


@pytest.mark.parametrize("name", NAMES)
def test_tcp_frames_round_trip_exactly(name):
    tcp_round_trip(*pools(name, shared=False))


@CUDA
@pytest.mark.parametrize("name", ["bfloat16", "dsa"])
def test_pages_from_a_cuda_pool_land_exactly(name):
    shm_round_trip(*pools(name, shared=True, src_device="cuda"))
    tcp_round_trip(*pools(name, shared=False, src_device="cuda"))


@CUDA
def test_tcp_frames_land_in_a_cuda_pool():
    src = KVPool(dsa(), 10, torch.device("cpu"))
    fill_random(src, seed=7)
    dst = KVPool(dsa(), 12, torch.device("cuda"))
    ctl = CapturingControl()
    TcpWriter(ctl, "d0", "p0").write(5, 2, RankPages.of(src), SRC, DST, 0.0)  # type: ignore[arg-type]
    ((_, msg, bulk),) = ctl.sent
    assert isinstance(msg, KVChunk)
    receive(dst, msg, bulk)
    for s, d in zip(SRC, DST, strict=True):
        assert torch.equal(dst.page(d).cpu(), src.page(s))


def chunk(pages: list[int], frames: list[bytes]) -> tuple[KVChunk, Bulk]:
    return KVChunk(room=5, epoch=2, dst_pages=pages), wire(Bulk.seal(frames))  # type: ignore[return-value]


def test_the_stager_refuses_wrong_sizes_before_hashing():
    _, dst = pools("dsa", shared=False)
    page = dst.layout.page_bytes
    cases = [
        (chunk([1, 2], [b"\x00" * page]), "1 frames for 2 pages"),
        (chunk([1], [b"\x00" * 3]), "bytes each"),
        (chunk([1], [b"\x00" * layout("bfloat16").page_bytes]), "bytes each"),  # another layout
        ((KVChunk(room=5, epoch=2, dst_pages=[1]), None), "0 frames for 1 pages"),
    ]
    for (msg, bulk), why in cases:
        staged = stage(msg, bulk, page)
        assert staged.rows is None and why in staged.refused


def test_a_frame_that_does_not_match_its_digest_is_refused():
    _, dst = pools("dsa", shared=False)
    page = dst.layout.page_bytes
    good = Bulk.seal([b"\x01" * page, b"\x02" * page])
    frames = [bytes(f) for f in good.frames()]
    frames[1] = b"\x03" + frames[1][1:]  # altered on the way
    msg = KVChunk(room=5, epoch=2, dst_pages=[1, 2])
    staged = stage(msg, Bulk.received(frames, good.digests), page)
    assert staged.rows is None and "bulk frame 1 of 2 does not match its digest" in staged.refused
    swapped = Bulk.received(frames[::-1], good.digests)  # right frames, wrong places
    assert "does not match" in stage(msg, swapped, page).refused


def test_the_tcp_receiver_refuses_rows_of_another_shape():
    _, dst = pools("dsa", shared=False)
    rx = TcpReceiver(RankPages.of(dst))
    with pytest.raises(ValueError, match="no staged pages"):
        rx.accept_rows(5, 2, [1], None)
    with pytest.raises(ValueError, match="shape"):
        rx.accept_rows(5, 2, [1, 2], torch.zeros(1, dst.layout.page_bytes, dtype=torch.uint8))
    assert not dst.data.any() and rx.landed() == []


class RecordingEvent:
    """Stands in for torch.cuda.Event (no GPU here): the step is still running at the first
    query and lands its pages at the second; records that the copy waited for it."""

    def __init__(self, src: KVPool) -> None:
        self.src, self.waited, self.queries = src, False, 0

    def query(self) -> bool:
        self.queries += 1
        if self.queries == 2:
            self.synchronize()
        return self.waited

    def synchronize(self) -> None:
        fill_random(self.src, seed=99)  # what the step computes lands only now
        self.waited = True


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_a_copy_waits_for_the_step_that_computes_its_pages(backend):
    src, dst = pools("bfloat16", shared=backend == "shm")
    step = RecordingEvent(src)
    try:
        if backend == "shm":
            assert dst.shm is not None
            ShmWriter([dst.shm], dst.layout, dst.num_pages).write(
                1, 1, RankPages.of(src), SRC, DST, 0.0, step
            )
        else:
            ctl = CapturingControl()
            writer = TcpWriter(ctl, "d0", "p0")  # type: ignore[arg-type]
            writer.write(5, 2, RankPages.of(src), SRC, DST, 0.0, step)
            ((_, msg, bulk),) = ctl.sent
            assert isinstance(msg, KVChunk)
            receive(dst, msg, bulk)
        assert step.waited
        assert_landed(src, dst)  # the bytes after the step, not before
    finally:
        dst.close()


def test_a_large_write_goes_in_chunks_of_at_most_its_bound(monkeypatch):
    src, dst = pools("bfloat16", shared=False)
    monkeypatch.setattr(control_limits, "MAX_CHUNK_BYTES", 2 * src.layout.page_bytes + 1)
    ctl = CapturingControl()
    TcpWriter(ctl, "d0", "p0").write(5, 2, RankPages.of(src), SRC, DST, 0.0)  # type: ignore[arg-type]
    chunks = [(msg, bulk) for _, msg, bulk in ctl.sent]
    assert [m.dst_pages for m, _ in chunks] == [DST[:2], DST[2:]]  # type: ignore[attr-defined]
    for msg, bulk in chunks:
        assert isinstance(msg, KVChunk)
        receive(dst, msg, bulk)
    assert_landed(src, dst)
    assert control_limits.chunk_pages(10**12) == 1  # a page larger than the bound goes alone
