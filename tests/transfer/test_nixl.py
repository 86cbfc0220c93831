"""nixl backend conformance: the same contract as shm and tcp, across two real processes.

P is this test process (a NixlAgent on a local pool); D is `nixl_peer.py` in a child process
whose pool lives in shared memory, so the test can read what landed. Covers scattered page
lists and page boundaries per layout (the Llama family per dtype; typed buffers of several
dtypes, fp8 among them; random bytes), many rooms in flight, cancel mid-write, a peer that is
gone (SIGKILL) and a peer that is stopped (SIGSTOP: NIXL waits for ever, our deadline does not).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdserve.kvcache.pool import KVPool, ShmRef, map_shared
from pdserve.protocol.messages import NixlPool
from pdserve.transfer.dataplane import PeerGone, WriteError
from pdserve.transfer.nixl import (
    NixlAgent,
    NixlTransfer,
    NixlWriter,
    nixl_available,
    page_runs,
    parse_notif,
    run_indices,
)
from tests.kvcache.layouts import NAMES, dsa, fill_random, layout

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")

PEER = Path(__file__).with_name("nixl_peer.py")
DST_PAGES = 12


class Peer:
    def __init__(self, layout_name: str, tag: str) -> None:
        self.layout = layout(layout_name)
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), json.dumps(self.layout.to_dict()), str(DST_PAGES), tag],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=Path(__file__).parents[2],
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        info = json.loads(self.readline())
        # The peer's pool as bytes [DST_PAGES, page_bytes]
        self.pool = map_shared(ShmRef(**info["shm"]), self.layout, DST_PAGES)
        self.descriptor = NixlPool(
            bytes.fromhex(info["md"]), info["base"], info["device_id"], info["mem"]
        )

    def readline(self, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:  # skip anything NIXL or UCX print on stdout
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError("nixl peer did not answer") from None
            if line.startswith("PEER "):
                return line[5:]
            if not line:
                raise RuntimeError("nixl peer exited")

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def landed(self) -> list[tuple[int, int, int]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("landed\n")
        self.proc.stdin.flush()
        return [tuple(x) for x in json.loads(self.readline())]

    def landed_until(self, nbytes: int, timeout_s: float = 10.0) -> list[tuple[int, int, int]]:
        got: list[tuple[int, int, int]] = []
        deadline = time.monotonic() + timeout_s
        while sum(n for *_, n in got) < nbytes and time.monotonic() < deadline:
            got += self.landed()
            time.sleep(0.01)
        return got

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def pair(request) -> Iterator[tuple[NixlWriter, KVPool, Peer]]:
    name = getattr(request, "param", "float32")
    peer = Peer(name, request.node.name[-24:].replace("[", "-").replace("]", ""))
    try:
        src = KVPool(peer.layout, 10, torch.device("cpu"))
        fill_random(src, seed=len(name))
        agent = NixlAgent(f"p-{os.getpid()}-{time.monotonic_ns()}", src)
        writer = NixlWriter(agent, peer.descriptor, peer.layout, DST_PAGES)
        try:
            yield writer, src, peer
        finally:
            peer.stop()
            agent.settle()  # let UCX fail what was queued for the peer before we drop it
            writer.close()
    finally:
        peer.stop()


def wait(x: NixlTransfer, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not x.poll():
        assert time.monotonic() < deadline, "transfer never completed"
        time.sleep(0.001)


def far() -> float:
    return time.monotonic() + 30.0


@pytest.mark.parametrize("name", NAMES)
def test_one_descriptor_per_page_covers_the_pool(name):
    lay = layout(name)
    pool = KVPool(lay, 5, torch.device("cpu"))
    runs = page_runs(lay, pool.data.data_ptr(), 5, 0)
    assert runs.shape == (5, 3)
    for p in range(5):  # each row is exactly page p's bytes, every layer and buffer
        assert runs[p, 0] == pool.page(p).data_ptr() == pool.data.data_ptr() + p * lay.page_bytes
        assert runs[p, 1] == pool.page(p).numel() == lay.page_bytes
        assert pool.page(p).is_contiguous()
    for r in lay.regions:  # and every typed view lies inside its page's run
        v = pool.view(r.layer, r.spec.name)
        assert runs[1, 0] <= v[1].data_ptr() < v[1].data_ptr() + r.nbytes <= runs[1, 0] + runs[1, 1]
    assert run_indices([3, 0]).tolist() == [3, 0]


def test_descriptors_follow_the_layout_not_a_dtype():
    """A bf16 buffer is never moved as fp8: the run length comes from the layout's buffers."""
    fp8 = dsa()
    bf16 = replace(fp8, buffers=tuple(
        replace(b, dtype="bfloat16") if b.name == "index_k" else b for b in fp8.buffers
    ))  # fmt: skip
    assert bf16.page_bytes - fp8.page_bytes == 2 * fp8.page_size * 128  # layers 0 and 2
    assert page_runs(bf16, 0, 2, 0)[1, 0] == bf16.page_bytes


def test_notifications_parse_or_are_refused():
    assert parse_notif(b"pdkv1 7 2 4096") == (7, 2, 4096)
    for bad in (b"", b"pdkv1 7 2", b"other 1 2 3", b"pdkv1 a b c", b"pdkv1 1 2 3 4"):
        assert parse_notif(bad) is None


SRC, DST = [7, 0, 3, 9], [11, 2, 5, 0]  # scattered, out of order, first and last page


@pytest.mark.process
@pytest.mark.parametrize("pair", NAMES, indirect=True)
def test_scattered_pages_land_exactly_with_a_notification(pair):
    writer, src, peer = pair
    x = writer.write(5, 2, src, SRC, DST, far())
    wait(x)
    assert x.nbytes == len(SRC) * peer.layout.page_bytes
    for s, d in zip(SRC, DST, strict=True):
        assert torch.equal(peer.pool[d], src.page(s))
    untouched = [p for p in range(DST_PAGES) if p not in DST]
    assert not peer.pool[untouched].any()
    assert peer.landed_until(x.nbytes) == [(5, 2, x.nbytes)]


@pytest.mark.process
def test_many_rooms_in_flight_at_once(pair):
    writer, src, peer = pair
    xs = [writer.write(100 + i, 1, src, [i], [i], far()) for i in range(10)]
    for x in xs:
        wait(x)
    landed = peer.landed_until(sum(x.nbytes for x in xs))
    assert sorted(landed) == [(100 + i, 1, xs[i].nbytes) for i in range(10)]
    for i in range(10):
        assert torch.equal(peer.pool[i], src.page(i))


class StandInEvent:
    """Stands in for torch.cuda.Event (no GPU here): completes when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        raise AssertionError("a NIXL write must never block the engine on its step")


@pytest.mark.process
def test_a_write_waits_for_its_step_before_it_reads_the_pages(pair):
    writer, src, peer = pair
    step = StandInEvent()
    x = writer.write(9, 1, src, [2], [4], far(), step)
    time.sleep(0.05)
    assert not x.poll() and not x.posted  # the step has not ended: nothing moved
    assert not peer.pool[4].any()
    step.done = True
    wait(x)
    assert x.posted and torch.equal(peer.pool[4], src.page(2))
    assert peer.landed_until(x.nbytes) == [(9, 1, x.nbytes)]


@pytest.mark.process
def test_cancel_mid_write_releases_and_the_writer_goes_on(pair):
    writer, src, peer = pair
    x = writer.write(1, 1, src, SRC, DST, far())
    x.cancel()  # landed or not, the handle is released and nobody waits on it
    assert x.done and x.poll()
    y = writer.write(2, 1, src, [1], [1], far())
    wait(y)
    assert torch.equal(peer.pool[1], src.page(1))
    assert not writer.agent.unreleased


def wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 5.0
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "SIGSTOP did not take effect"
        time.sleep(0.01)


@pytest.mark.process
def test_a_stopped_peer_times_out_by_our_deadline(pair):
    writer, src, peer = pair
    wait(writer.write(1, 1, src, [0], [0], far()))  # connected
    os.kill(peer.proc.pid, signal.SIGSTOP)
    wait_stopped(peer.proc.pid)
    big = list(range(10))
    deadline = time.monotonic() + 1.0
    t0 = time.monotonic()
    with pytest.raises(WriteError):
        try:
            x = writer.write(2, 1, src, big, big, deadline)
        except WriteError:
            raise
        while not x.poll():
            assert time.monotonic() < deadline + 5, "our deadline did not end the transfer"
            time.sleep(0.01)
    assert time.monotonic() - t0 < 6.0


@pytest.mark.process
def test_a_dead_peer_fails_the_write(pair):
    writer, src, peer = pair
    wait(writer.write(1, 1, src, [0], [0], far()))
    peer.proc.kill()
    peer.proc.wait(timeout=10)
    t0 = time.monotonic()
    with pytest.raises(PeerGone):  # typed: the prefill role then fails every room of the peer
        for _ in range(50):  # UCX may need a few writes to notice the peer is gone
            x = writer.write(2, 1, src, [1], [1], time.monotonic() + 2.0)
            while not x.poll():
                time.sleep(0.01)
    assert time.monotonic() - t0 < 30.0


def test_the_wheel_for_torchs_cuda_is_tried_first():
    from pdserve.transfer.nixl import nixl_modules

    assert nixl_modules("13.0") == ("nixl_cu13", "nixl_cu12", "nixl._api")
    assert nixl_modules("12.8") == ("nixl_cu12", "nixl_cu13", "nixl._api")
    assert nixl_modules(None)[-1] == "nixl._api"  # a CPU build takes whichever is installed
