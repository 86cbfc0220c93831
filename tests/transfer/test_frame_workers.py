"""Frame workers: per-frame work spread over supervised threads, the caller taking its share."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.runtime.supervisor import Supervisor
from pdserve.transfer import frame_workers
from pdserve.transfer.frame_workers import FrameWorkers, default_workers


def started(workers: FrameWorkers) -> Supervisor:
    sup = Supervisor()
    for i in range(workers.workers):
        sup.spawn(f"frames-{i}", workers.tick)
    return sup


def test_items_run_on_the_workers_and_the_caller_in_order_of_results():
    fw = FrameWorkers(3)
    sup = started(fw)
    try:
        ran_on: dict[int, str] = {}

        def item(i: int) -> int:
            ran_on[i] = threading.current_thread().name
            time.sleep(0.01)  # long enough that every worker takes some
            return i * i

        assert list(fw.map(item, 24)) == [i * i for i in range(24)]
        names = set(ran_on.values())
        assert threading.current_thread().name in names and len(names) >= 2, names
        assert list(fw.map(item, 0)) == []
    finally:
        assert sup.stop() == []


def test_without_workers_the_caller_does_everything():
    fw = FrameWorkers(2)  # no thread was started: the queued shares are never taken
    assert list(fw.map(lambda i: i + 1, 5)) == [1, 2, 3, 4, 5]
    assert FrameWorkers(0).map(str, 3) == ["0", "1", "2"]


def test_an_item_s_error_is_raised_in_the_caller_and_the_workers_go_on():
    fw = FrameWorkers(2)
    sup = started(fw)
    try:

        def item(i: int) -> int:
            if i == 3:
                raise ValueError("frame 3 is bad")
            return i

        with pytest.raises(ValueError, match="frame 3 is bad"):
            fw.map(item, 40)
        assert list(fw.map(lambda i: i, 10)) == list(range(10))  # the next batch is whole
        assert all(t["alive"] and t["crashes"] == 0 for t in sup.snapshot())
    finally:
        assert sup.stop() == []


def test_an_item_a_worker_holds_too_long_times_out(monkeypatch):
    monkeypatch.setattr(frame_workers, "FRAME_WORK_WAIT_S", 0.2)
    fw = FrameWorkers(1)
    release = threading.Event()
    sup = started(fw)
    try:

        def item(i: int) -> None:
            if threading.current_thread().name.startswith("frames-"):
                release.wait(5)  # a worker stuck in a call
            else:
                time.sleep(0.05)  # the caller: slow enough that the worker takes one

        with pytest.raises(TimeoutError, match="frame worker held an item"):
            fw.map(item, 2)
    finally:
        release.set()
        assert sup.stop() == []


def test_how_many_workers():
    assert [default_workers(n) for n in (1, 2, 4, 8, 16, 64)] == [0, 0, 0, 2, 3, 3]
