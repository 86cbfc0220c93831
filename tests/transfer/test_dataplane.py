"""Data-plane conformance on both backends: scattered page lists land byte-exact, per dtype."""

from __future__ import annotations

import pytest
import torch

from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPool
from pdserve.protocol.messages import KVChunk, Msg
from pdserve.transfer.dataplane import ShmWriter, TcpWriter, receive_chunk


class CapturingControl:
    """Stands in for the control plane's send queue (the socket itself is tested elsewhere)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Msg, tuple[bytes, ...]]] = []

    def send(self, peer: str, msg: Msg, frames: tuple[bytes, ...] = ()) -> None:
        self.sent.append((peer, msg, frames))


def pools(dtype: str, shared: bool) -> tuple[KVPool, KVPool]:
    layout = KVLayout(dtype, page_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
    src = KVPool(layout, 10, torch.device("cpu"))
    src.data.copy_(torch.randn(src.data.shape).to(src.data.dtype))
    dst = KVPool(layout, 12, torch.device("cpu"), shared=shared)
    return src, dst


SRC, DST = [7, 0, 3, 9], [11, 2, 5, 0]  # scattered, out of order, page 0 included


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_shm_writes_scattered_pages_exactly(dtype):
    src, dst = pools(dtype, shared=True)
    try:
        assert dst.shm is not None
        writer = ShmWriter(dst.shm, dst.layout, dst.num_pages)
        done = writer.write(1, 1, src, SRC, DST, deadline=0.0)
        assert done.poll(), "shm completes inside write()"
        assert done.nbytes == len(SRC) * src.layout.bytes_per_page_all_layers
        for s, d in zip(SRC, DST, strict=True):
            assert torch.equal(dst.data[d], src.data[s])
        untouched = [p for p in range(dst.num_pages) if p not in DST]
        assert not dst.data[untouched].any()
    finally:
        dst.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_tcp_frames_round_trip_exactly(dtype):
    src, dst = pools(dtype, shared=False)
    ctl = CapturingControl()
    sent = TcpWriter(ctl, "d0", "p0").write(5, 2, src, SRC, DST, 0.0)  # type: ignore[arg-type]
    assert sent.poll() and sent.nbytes == len(SRC) * src.layout.bytes_per_page_all_layers
    ((peer, msg, frames),) = ctl.sent
    assert peer == "d0" and isinstance(msg, KVChunk) and msg.dst_pages == DST
    assert (msg.room, msg.epoch) == (5, 2)
    receive_chunk(dst, msg.dst_pages, frames)
    for s, d in zip(SRC, DST, strict=True):
        assert torch.equal(dst.data[d], src.data[s])


def test_tcp_receiver_refuses_wrong_sizes():
    src, dst = pools("float32", shared=False)
    with pytest.raises(ValueError, match="frames"):
        receive_chunk(dst, [1, 2], [b"\x00" * dst.layout.bytes_per_page_all_layers])
    with pytest.raises(ValueError, match="bytes each"):
        receive_chunk(dst, [1], [b"\x00" * 3])
