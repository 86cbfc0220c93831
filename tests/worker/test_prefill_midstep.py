"""A prefill worker answers a write that finished while its engine waits for a step on the device
(engine/role.py `Role.while_waiting`), not a step later: a room's PrefillDone leaves mid-step.

Two stand-ins, named as such, for what the CPU does not have:
- **a device step**: while `Device.on`, each step's tokens are waited for in
  `gpu_wait.wait_event` for `step_s`, as the engine thread waits for a GPU step (on the CPU a
  forward has ended when it returns, so nothing is ever waited for);
- **a NIXL write in flight**: the real shm copy is done at once, but the write reports itself
  complete only once the test says it landed (`HeldWrite.landed`), as a NIXL WRITE completes
  in UCX's background while the engine computes.

Both engines are real (tests/worker/wire.py), and so are the rooms, the steps and the KV.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from pdserve.engine.inflight import InFlight
from pdserve.engine.offline import build_engine, generate
from pdserve.kvcache.lease import Lease
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams
from pdserve.runtime.gpu_wait import wait_event
from pdserve.transfer.errors import PeerGone, WriteError
from pdserve.worker.prefill.rooms import PRoom
from tests.worker.wire import D_ID, Wire, ended, tokens

SHORT = [(i * 5) % 190 + 4 for i in range(9)]  # one chunk (16) on P
LONG = [(i * 7) % 200 + 3 for i in range(37)]  # three chunks
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
STEP_S = 0.05  # a stand-in step: ample for a hundred half-millisecond calls of while_waiting


class Device:
    """The stand-in device step (see the header): while `on`, a launched step "runs" for
    STEP_S from its launch, and the engine thread waits for its end as for a GPU's, through
    `InFlight.wait` or, for a step that sampled, its tokens (`InFlight.picks`). `at_launch`
    runs as a step is launched: what happens while it runs."""

    def __init__(self) -> None:
        self.on = False
        self.at_launch: Callable[[], None] = lambda: None
        self.end = 0.0  # the last stand-in step's end (time.monotonic)

    def running(self) -> bool:
        return time.monotonic() < self.end

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        launched, picks = InFlight.launched, InFlight.picks
        device = self

        def launched_on_the_device(step: InFlight, where: Any) -> None:
            launched(step, where)
            if device.on:
                done = Until(STEP_S)
                device.end = done.at
                step._done = done  # type: ignore[assignment]
                device.at_launch()

        def picks_after_the_step(step: InFlight, meanwhile: Any = None) -> Any:
            if step._done is not None and step.sampled is not None:  # the ids land at its end
                wait_event(step._done, "a stand-in step", meanwhile=meanwhile)
            return picks(step, meanwhile)

        monkeypatch.setattr(InFlight, "launched", launched_on_the_device)
        monkeypatch.setattr(InFlight, "picks", picks_after_the_step)


class Until:
    """Reached `seconds` after it was made (the stand-in step's end)."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def query(self) -> bool:
        return time.monotonic() >= self.at


class HeldWrite:
    """The stand-in NIXL write (see the header): complete once `landed`; raises `error` if set."""

    def __init__(self, nbytes: int, room: int, device: Device) -> None:
        self.nbytes, self.room, self.device = nbytes, room, device
        self.landed = False
        self.error: Exception | None = None
        self.polls_mid_step = 0

    def poll(self) -> bool:
        self.polls_mid_step += self.device.running()
        if self.error is not None:
            raise self.error
        return self.landed

    def cancel(self) -> None:
        pass


class HoldingWriter:
    """Wraps the peer's real shm writer: the pages are copied, the write held (HeldWrite)."""

    def __init__(self, inner: Any, device: Device) -> None:
        self.inner, self.device = inner, device
        self.writes: list[HeldWrite] = []
        self.hold = True  # False: each write lands as it is posted
        self.refuse: set[int] = set()  # rooms whose next writes fail as they are posted

    def write(self, room: int, *args: Any, **kwargs: Any) -> HeldWrite:
        if room in self.refuse:
            raise WriteError("the stand-in refused this room's write")
        done = self.inner.write(room, *args, **kwargs)
        held = HeldWrite(done.nbytes, room, self.device)
        held.landed = not self.hold
        self.writes.append(held)
        return held

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def setup(tiny_dir, monkeypatch):
    """A paired P and D (one request served first), P's writes held, the device stand-in
    installed (off), and what P sends recorded as (message, room, sent mid-step)."""
    wire = Wire(tiny_dir)
    first = wire.submit("r0", SHORT, GREEDY)
    wire.run_until(lambda: ended(first))
    device = Device()
    device.install(monkeypatch)
    peer = wire.p_role.peers.get(D_ID)
    assert peer is not None
    writer = HoldingWriter(peer.writer, device)
    peer.writer = writer  # type: ignore[assignment]
    sent: list[tuple[str, int, bool]] = []
    deliver = wire.p.transport

    def record(out: Any) -> None:
        sent.append((type(out.msg).__name__, getattr(out.msg, "room", -1), device.running()))
        deliver(out)

    wire.p.transport = record
    return wire, device, writer, sent


def p_room(wire: Wire, prompt: list[int]) -> PRoom | None:
    rooms = [r for r in wire.p_role.by_room.values() if r.request.prompt_ids == prompt]
    return rooms[0] if rooms else None


def written_out_of_batch(wire: Wire, prompt: list[int]) -> bool:
    """The room's prompt is computed and its request left the batch; its writes are held."""
    room = p_room(wire, prompt)
    return room is not None and not room.in_batch and bool(room.inflight)


def next_step_waits_on_p(wire: Wire) -> list[RequestOutput]:
    """The long prompt's PrefillRequest sent by D and queued on P, for P's next tick."""
    outs = wire.submit("r2", LONG, GREEDY)
    wire.run_until(lambda: wire.p.inbox.qsize() > 0, p=False)
    return outs


def test_a_write_that_lands_mid_step_is_answered_before_the_step_ends(setup, tiny_dir):
    wire, device, writer, sent = setup
    first = wire.submit("r1", SHORT, GREEDY)
    wire.run_until(lambda: written_out_of_batch(wire, SHORT))
    room1 = p_room(wire, SHORT)
    assert room1 is not None
    second = next_step_waits_on_p(wire)
    r1_writes = [w for w in writer.writes if w.room == room1.room]

    def land() -> None:
        for w in r1_writes:
            w.landed = True

    device.on, device.at_launch = True, land
    wire.tick(d=False)  # P: r2's first chunk, during which r1's writes land
    assert ("PrefillDone", room1.room, True) in sent  # answered mid-step
    room2 = p_room(wire, LONG)
    assert room2 is not None and room2.in_batch  # its first chunk was that step
    r2_writes = [w for w in writer.writes if w.room == room2.room]
    assert r2_writes, "the step wrote r2's first pages"
    assert all(w.polls_mid_step == 0 for w in r2_writes)  # a room in the batch waits

    # The rest runs as usual, every write landing when posted: both requests give the
    # tokens a co-located run gives, and nothing is left held.
    device.on, writer.hold = False, False
    for w in writer.writes:
        w.landed = True
    wire.run_until(lambda: ended(first) and ended(second) and wire.idle())
    colocated = build_engine(tiny_dir, page_size=4, max_batched_tokens=16, kv_budget_mb=4.0)
    assert [tokens(first), tokens(second)] == generate(colocated, [SHORT, LONG], GREEDY)
    assert wire.violations() == []


def test_a_peer_found_gone_mid_step_is_dropped_by_the_next_tick_not_mid_step(setup):
    wire, device, writer, sent = setup
    wire.submit("r1", SHORT, GREEDY)
    wire.run_until(lambda: written_out_of_batch(wire, SHORT))
    room1 = p_room(wire, SHORT)
    assert room1 is not None
    next_step_waits_on_p(wire)

    def gone() -> None:
        for w in writer.writes:
            if w.room == room1.room:
                w.error = PeerGone("the stand-in's peer disconnected")

    device.on, device.at_launch = True, gone
    wire.tick(d=False)
    # r1's room, out of the batch, failed mid-step; r2's, in the batch, is untouched, and the
    # peer is still paired: dropping it would fail r2's room mid-step.
    assert ("PrefillFailed", room1.room, True) in sent
    assert wire.p_role.peers.get(D_ID) is not None
    room2 = p_room(wire, LONG)
    assert room2 is not None and room2.in_batch
    device.on = False
    wire.tick(d=False)  # the tick's own poll drops the peer, and fails r2's room with it
    assert wire.p_role.peers.get(D_ID) is None
    assert any(s[0] == "PrefillFailed" and s[1] == room2.room and not s[2] for s in sent)


def test_a_room_the_step_computes_is_left_alone_mid_step_though_it_left_the_batch(
    setup, monkeypatch
):
    """A room whose write failed as its chunk's step launched leaves the batch with its pages
    (FAILING, an earlier write still in flight); the device may still write those pages until
    the step ends, so even once that earlier write lands mid-step, the room is not answered
    (nor its pages freed) before the step's end."""
    wire, device, writer, sent = setup
    wire.submit("r2", LONG, GREEDY)
    room = None

    def first_chunk_written() -> bool:
        nonlocal room
        room = p_room(wire, LONG)
        return room is not None and bool(room.inflight)

    wire.run_until(first_chunk_written)
    assert room is not None and room.in_batch
    earlier = list(writer.writes)

    def land() -> None:
        for w in earlier:
            w.landed = True

    writer.refuse.add(room.room)
    device.on, device.at_launch = True, land
    freed_mid_step: list[bool] = []  # each release of the room's pages: during the step?
    release = Lease.release

    def watched_release(lease: Lease) -> None:
        if lease.owner == f"room {room.room}":  # the pages the room kept (KeepPages)
            freed_mid_step.append(device.running())
        release(lease)

    monkeypatch.setattr(Lease, "release", watched_release)
    wire.tick(d=False)  # its second chunk: the write fails as the step launches
    assert not room.in_batch and room.state.value == "failing"
    assert not any(s[0] == "PrefillFailed" for s in sent)  # not mid-step
    assert freed_mid_step == []
    device.on = False
    wire.tick(d=False)  # the tick's own poll: the room fails and frees its pages
    assert ("PrefillFailed", room.room, False) in sent
    assert freed_mid_step == [False]


def test_a_role_that_raises_mid_step_costs_no_token_and_is_counted(setup, tiny_dir, monkeypatch):
    wire, device, writer, sent = setup
    calls: list[float] = []

    def broken(now: float, in_step: Any) -> None:
        calls.append(now)
        raise RuntimeError("a bug in the role's mid-step work")

    monkeypatch.setattr(wire.p_role, "while_waiting", broken)
    errors = "pdserve_step_errors_total"
    before = wire.p.metrics.registry.get_sample_value(errors) or 0.0
    device.on, writer.hold = True, False
    outs = wire.submit("r1", LONG, GREEDY)
    wire.run_until(lambda: ended(outs) and wire.idle())
    colocated = build_engine(tiny_dir, page_size=4, max_batched_tokens=16, kv_budget_mb=4.0)
    assert tokens(outs) == generate(colocated, [LONG], GREEDY)[0]  # the steps went on
    # Once a tick at most: after it raised, the role is not asked again until the next tick.
    assert len(calls) >= 1 and wire.p.metrics.registry.get_sample_value(errors) == before + len(
        calls
    )
