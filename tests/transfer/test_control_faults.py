"""Message faults on a real control plane: a decode-side Control talking to a prefill-side one
over loopback ZMQ, each ticked by a supervised thread as in a worker."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from pdserve.protocol.messages import Message, Msg, Ping, Pong
from pdserve.runtime.cluster_key import ClusterKey
from pdserve.runtime.faults import FAULTS
from pdserve.runtime.supervisor import Supervisor
from pdserve.transfer import control
from pdserve.transfer.control import Control, Inbound


@dataclass
class Pair:
    p: Control  # binds, receives
    d: Control  # connects, sends
    sup: Supervisor
    got: list[Message] = field(default_factory=list)  # what P's on_message saw, in order

    def send(self, *msgs: Msg) -> None:
        for msg in msgs:
            self.d.send(self.p.address, msg)

    def seen(self) -> list[tuple[str, int]]:
        return [(type(m).__name__, getattr(m, "nonce", -1)) for m in self.got]

    def wait_for(self, n: int, timeout_s: float = 5.0) -> list[tuple[str, int]]:
        wait_until(lambda: len(self.got) >= n, timeout_s)
        time.sleep(0.05)  # room for a message too many to show up
        return self.seen()

    def threads_unhurt(self) -> bool:
        return all(t["alive"] and t["crashes"] == 0 for t in self.sup.snapshot())


def wait_until(pred: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def never_fails(peer: str, msg: Msg, why: str) -> None:
    raise AssertionError(f"send to {peer} failed: {why}")


@pytest.fixture
def pair() -> Iterator[Pair]:
    sup = Supervisor(restart_budget=0)
    got: list[Message] = []

    def on_message(inbound: Inbound) -> None:
        got.append(inbound.msg)

    key = ClusterKey(secrets.token_bytes(32))
    p = Control("p-test", on_message, never_fails, key)
    p.bind("127.0.0.1", 0)
    d = Control("d-test", lambda inbound: None, never_fails, key)
    sup.spawn("control-p", p.tick)
    sup.spawn("control-d", d.tick)
    try:
        yield Pair(p, d, sup, got)
    finally:
        FAULTS.configure("", 0)
        assert sup.stop(2.0) == []
        p.close()
        d.close()


@pytest.mark.parametrize("direction", ["recv", "send"])
def test_duplicate_delivers_twice(pair, direction):
    FAULTS.configure(f"control.{direction}.Ping=duplicate", 0)
    pair.send(Ping(nonce=1), Pong(nonce=2))
    assert pair.wait_for(3) == [("Ping", 1), ("Ping", 1), ("Pong", 2)]
    assert pair.d.stats.sent["Ping"] == (2 if direction == "send" else 1)
    assert pair.p.stats.received["Ping"] == (2 if direction == "send" else 1)
    assert FAULTS.snapshot()["fired"] == {f"control.{direction}.Ping": 1}


@pytest.mark.parametrize("direction", ["recv", "send"])
def test_reorder_swaps_a_message_with_the_next(pair, direction):
    FAULTS.configure(f"control.{direction}.Ping=reorder", 0)
    pair.send(Ping(nonce=1), Pong(nonce=2), Pong(nonce=3))
    assert pair.wait_for(3) == [("Pong", 2), ("Ping", 1), ("Pong", 3)]


@pytest.mark.parametrize("direction", ["recv", "send"])
def test_a_reordered_message_with_none_after_it_is_held_at_most_hold_s(
    pair, direction, monkeypatch
):
    monkeypatch.setattr(control, "HOLD_S", 0.3)
    FAULTS.configure(f"control.{direction}.Ping=reorder", 0)
    t0 = time.monotonic()
    pair.send(Ping(nonce=1))
    assert pair.wait_for(1) == [("Ping", 1)]
    assert 0.3 <= time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("direction", ["recv", "send"])
@pytest.mark.parametrize(
    ("action", "kind"), [("unknown", "unknown_type"), ("malformed", "malformed")]
)
def test_unknown_and_malformed_frames_are_counted_dropped_and_survived(
    pair, direction, action, kind
):
    FAULTS.configure(f"control.{direction}.Ping={action}", 0)
    pair.send(Ping(nonce=1), Pong(nonce=2))
    assert pair.wait_for(1) == [("Pong", 2)]
    assert pair.p.stats.dropped == {kind: 1}
    assert pair.threads_unhurt(), pair.sup.snapshot()
    FAULTS.configure("", 0)
    pair.send(Ping(nonce=3))  # the reader goes on as before
    assert pair.wait_for(2) == [("Pong", 2), ("Ping", 3)]


def test_drop_loses_the_message(pair):
    FAULTS.configure("control.recv.Ping=drop", 0)
    pair.send(Ping(nonce=1), Pong(nonce=2))
    assert pair.wait_for(1) == [("Pong", 2)]
    assert pair.p.stats.received == {"Ping": 1, "Pong": 1} and pair.threads_unhurt()


def test_a_send_wakes_the_io_thread_out_of_poll(pair, monkeypatch):
    """A send does not wait for the I/O thread's poll timeout: send() wakes it (a pipe)."""
    monkeypatch.setattr(control, "POLL_MS", 5000)
    pair.p.wake()
    pair.d.wake()  # both I/O threads now go back to sleep with the 5 s timeout
    time.sleep(0.2)
    pair.send(Ping(nonce=1))
    try:
        assert pair.wait_for(1, timeout_s=2.0) == [("Ping", 1)]  # not after 5 s
    finally:
        monkeypatch.setattr(control, "POLL_MS", 100)
        pair.p.wake()
        pair.d.wake()  # so that both threads stop in time at teardown
