"""The data-plane worker: copies run off the caller's thread, fail or cancel cleanly."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pdserve.kvcache.pool import KVPool
from pdserve.kvcache.rank_pages import RankPages
from pdserve.transfer.copier import Copier
from pdserve.transfer.dataplane import ShmWriter, WriteError
from tests.kvcache.layouts import dsa, fill_random


def far() -> float:
    return time.monotonic() + 30.0


def test_a_copy_runs_on_the_worker_and_polls_done():
    c = Copier()
    ran_on: list[str] = []
    x = c.submit(10, lambda: ran_on.append(threading.current_thread().name), far())
    assert not x.poll() and ran_on == []  # queued: nothing ran on the caller's thread
    t = threading.Thread(target=c.tick, name="dataplane")
    t.start()
    t.join(5)
    assert x.poll() and ran_on == ["dataplane"] and c.copied == 1


def test_a_failed_copy_is_a_write_error():
    c = Copier()

    def boom() -> None:
        raise OSError("peer memory gone")

    x = c.submit(10, boom, far())
    c.tick()
    with pytest.raises(WriteError, match="peer memory gone"):
        x.poll()


def test_cancelled_before_it_ran_never_runs():
    c = Copier()
    ran: list[int] = []
    x = c.submit(10, lambda: ran.append(1), far())
    x.cancel()
    c.tick()
    assert x.poll() and ran == [] and c.copied == 0


def test_a_copy_not_run_by_its_deadline_fails_and_is_cancelled():
    c = Copier()
    ran: list[int] = []
    x = c.submit(10, lambda: ran.append(1), time.monotonic() - 0.001)
    with pytest.raises(WriteError, match="deadline"):
        x.poll()
    c.tick()
    assert ran == []


def test_shm_writer_through_the_worker_lands_the_pages():
    layout = dsa()  # typed buffers of three dtypes: the copy moves bytes
    src = KVPool(layout, 6, torch.device("cpu"))
    fill_random(src, seed=3)
    dst = KVPool(layout, 8, torch.device("cpu"), shared=True)
    c = Copier()
    try:
        assert dst.shm is not None
        w = ShmWriter([dst.shm], layout, 8, c)
        x = w.write(1, 1, RankPages.of(src), [5, 0], [7, 2], far())
        assert not dst.data.any()  # not yet: the worker has not run
        c.tick()
        assert x.poll() and x.nbytes == 2 * layout.page_bytes
        assert torch.equal(dst.page(7), src.page(5)) and torch.equal(dst.page(2), src.page(0))
    finally:
        dst.close()
