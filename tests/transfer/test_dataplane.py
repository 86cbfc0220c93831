"""Data-plane conformance on both backends: scattered page lists land byte-exact, for every
layout (the Llama family per dtype; typed buffers of several dtypes, fp8 among them)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kvcache.pool import KVPool
from pdserve.kvcache.rank_pages import RankPages
from pdserve.protocol.messages import KVChunk, Msg
from pdserve.transfer.dataplane import ShmWriter, TcpWriter, receive_chunk
from tests.kvcache.layouts import NAMES, dsa, fill_random, layout

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


class CapturingControl:
    """Stands in for the control plane's send queue (the socket itself is tested elsewhere)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Msg, tuple[bytes, ...]]] = []

    def send(self, peer: str, msg: Msg, frames: tuple[bytes, ...] = ()) -> None:
        self.sent.append((peer, msg, frames))


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
    ((peer, msg, frames),) = ctl.sent
    assert peer == "d0" and isinstance(msg, KVChunk) and msg.dst_pages == DST
    assert (msg.room, msg.epoch) == (5, 2)
    assert [len(f) for f in frames] == [src.layout.page_bytes] * len(SRC)  # a frame per page
    assert receive_chunk(RankPages.of(dst), msg.dst_pages, frames) == sent.nbytes
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
    ((_, msg, frames),) = ctl.sent
    receive_chunk(RankPages.of(dst), msg.dst_pages, frames)
    for s, d in zip(SRC, DST, strict=True):
        assert torch.equal(dst.page(d).cpu(), src.page(s))


def test_tcp_receiver_refuses_wrong_sizes():
    src, dst = pools("dsa", shared=False)
    with pytest.raises(ValueError, match="frames"):
        receive_chunk(RankPages.of(dst), [1, 2], [b"\x00" * dst.layout.page_bytes])
    with pytest.raises(ValueError, match="bytes each"):
        receive_chunk(RankPages.of(dst), [1], [b"\x00" * 3])
    with pytest.raises(ValueError, match="bytes each"):  # a page of another layout
        receive_chunk(RankPages.of(dst), [1], [b"\x00" * layout("bfloat16").page_bytes])
    assert not dst.data.any()


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
            ((_, msg, frames),) = ctl.sent
            receive_chunk(RankPages.of(dst), msg.dst_pages, frames)
        assert step.waited
        assert_landed(src, dst)  # the bytes after the step, not before
    finally:
        dst.close()
