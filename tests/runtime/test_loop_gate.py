"""runtime/loop_gate.py: the worker's event loop starts its turns while the engine thread waits
(for the GPU in gpu_wait.wait_event, or idle for its inbox), and never waits past its bound."""

from __future__ import annotations

import asyncio
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.runtime import gpu_wait, loop_gate
from pdserve.runtime.loop_gate import GatedSelector, LoopGate


@pytest.fixture
def installed() -> Iterator[LoopGate]:
    """A gate claimed by this (the test's) thread, whose waits in gpu_wait open it."""
    gate = LoopGate()
    gate.claim()
    gpu_wait.open_while_waiting(gate)
    try:
        yield gate
    finally:
        gpu_wait.open_while_waiting(None)


def test_the_owner_opens_it_only_while_it_waits() -> None:
    gate = LoopGate()
    assert gate.wait_turn(0)  # open until an engine claims it
    gate.claim()
    assert not gate.wait_turn(0)
    with gate.waiting():
        assert gate.wait_turn(0)
    assert not gate.wait_turn(0)


def test_another_threads_wait_leaves_it_closed() -> None:
    gate = LoopGate()
    gate.claim()
    seen: list[bool] = []

    def other() -> None:  # the dataplane thread, say
        with gate.waiting():
            seen.append(gate.wait_turn(0))

    t = threading.Thread(target=other)
    t.start()
    t.join(5)
    assert seen == [False]


def test_it_closes_again_when_the_wait_raises() -> None:
    gate = LoopGate()
    gate.claim()
    with pytest.raises(RuntimeError), gate.waiting():
        raise RuntimeError("the wait failed")
    assert not gate.wait_turn(0)


class Watched:
    """An event reached after `n` queries that records, at each query, whether the gate was
    open (the GPU wait polls it)."""

    def __init__(self, gate: LoopGate, n: int) -> None:
        self.gate, self.n = gate, n
        self.open_at_query: list[bool] = []

    def query(self) -> bool:
        self.open_at_query.append(self.gate.wait_turn(0))
        return len(self.open_at_query) > self.n


def test_a_gpu_wait_opens_it_while_polling(installed: LoopGate) -> None:
    e = Watched(installed, 3)
    gpu_wait.wait_event(e, "a step")
    # the first query is the fast path (reached already?), then it polls with the gate open
    assert e.open_at_query == [False, True, True, True]
    assert not installed.wait_turn(0)


def test_a_reached_event_does_not_open_it(installed: LoopGate) -> None:
    e = Watched(installed, 0)
    gpu_wait.wait_event(e, "a step")
    assert e.open_at_query == [False]


def test_a_gpu_wait_past_its_bound_closes_it(installed: LoopGate) -> None:
    e = Watched(installed, 10**9)
    with pytest.raises(gpu_wait.GpuWaitTimeout):
        gpu_wait.wait_event(e, "a step", timeout_s=0.02)
    assert not installed.wait_turn(0)


class Counted(LoopGate):
    """A gate that records what the selector's waits for it returned."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: list[bool] = []

    @property
    def asked(self) -> int:
        return len(self.answers)

    def wait_turn(self, max_wait_s: float) -> bool:
        self.answers.append(super().wait_turn(max_wait_s))
        return self.answers[-1]


def _read_one(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> asyncio.Future[bytes]:
    """A future of the first byte `sock` receives, read by `loop`."""
    got: asyncio.Future[bytes] = loop.create_future()

    def read() -> None:
        if not got.done():
            got.set_result(sock.recv(1))

    loop.add_reader(sock, read)
    return got


def _loop_with(gate: LoopGate, max_wait_s: float) -> asyncio.AbstractEventLoop:
    return asyncio.SelectorEventLoop(GatedSelector(gate, max_wait_s))


def test_ready_io_waits_for_the_engine_to_wait() -> None:
    """With the gate closed, a readable socket's callback runs only once the engine opens it
    (the bound here is far longer than the test)."""
    gate = LoopGate()
    loop = _loop_with(gate, max_wait_s=30.0)
    a, b = socket.socketpair()
    order: list[str] = []
    opened = threading.Event()

    def engine() -> None:  # writes, works a while with the gate closed, then waits
        gate.claim()
        b.send(b"x")
        time.sleep(0.2)
        order.append("engine waits")
        with gate.waiting():
            opened.set()
            time.sleep(0.2)

    try:
        got = _read_one(loop, a)
        t = threading.Thread(target=engine)
        loop.call_later(0.05, t.start)  # the loop is idle, in a blocking select, when it writes
        assert loop.run_until_complete(asyncio.wait_for(got, 10)) == b"x"
        order.append("loop ran")
        t.join(5)
        assert order == ["engine waits", "loop ran"]
        assert opened.is_set()
    finally:
        loop.close()
        a.close()
        b.close()


def test_a_loop_in_the_middle_of_its_turn_is_not_held() -> None:
    """Only a loop woken from idle waits: a select with timeout 0 (callbacks queued) returns
    its ready I/O at once, however closed the gate."""

    gate = Counted()
    gate.claim()
    sel = GatedSelector(gate, max_wait_s=0.01)
    a, b = socket.socketpair()
    try:
        sel.register(a, selectors.EVENT_READ)
        b.send(b"z")
        assert [key.fileobj for key, _ in sel.select(0)] == [a]
        assert gate.asked == 0
        assert [key.fileobj for key, _ in sel.select(1.0)] == [a]  # idle, woken: it asks
        assert gate.asked == 1
    finally:
        sel.close()
        a.close()
        b.close()


def test_a_host_bound_engine_still_lets_the_loop_in() -> None:
    """The gate never opens (an engine that never waits): the loop's turn starts after its
    bound, not never."""
    gate = Counted()
    gate.claim()
    loop = _loop_with(gate, max_wait_s=0.01)
    a, b = socket.socketpair()
    try:
        got = _read_one(loop, a)
        loop.call_later(0.05, b.send, b"y")  # to a loop idle in a blocking select
        assert loop.run_until_complete(asyncio.wait_for(got, 10)) == b"y"
        assert gate.answers == [False]  # it waited for the gate, which stayed closed
    finally:
        loop.close()
        a.close()
        b.close()


def test_an_idle_engine_opens_it_and_a_stepping_one_closes_it(tiny_dir: Path) -> None:
    """The engine's tick: it claims the gate, holds it open while it blocks on its inbox,
    and has it closed while it handles commands and steps (the device wait on a GPU is
    gpu_wait's, above)."""
    from pdserve.engine.params import SamplingParams
    from tests.helpers import make_engine

    eng = make_engine(tiny_dir)
    gate = eng.loop_gate = LoopGate()
    at_get: list[bool] = []  # the gate at each read of the inbox, blocking or not
    real_get = eng.inbox.get

    def get(*args: object, **kwargs: object) -> object:
        at_get.append(gate.wait_turn(0))
        return real_get(*args, **kwargs)  # type: ignore[arg-type]

    eng.inbox.get = get  # type: ignore[method-assign]  # get_nowait reads through it too
    eng.tick()  # idle: blocks for its inbox, the gate open
    assert gate.owner == threading.get_ident()
    assert at_get == [True] and not gate.wait_turn(0)
    eng.submit("r", [1, 2, 3], SamplingParams(max_tokens=2), lambda _o: None)
    at_step: list[bool] = []
    real_step = eng.step

    def step() -> None:
        at_step.append(gate.wait_turn(0))
        real_step()

    eng.step = step  # type: ignore[method-assign]
    eng.tick()  # a blocking read (open) brings the submit; the next read and the step: closed
    eng.tick()  # work left: a read that does not block, and a step, both closed
    assert at_get == [True, True, False, False] and at_step == [False, False]


@pytest.mark.parametrize(
    ("value", "event_loop", "answer"),
    [
        (None, "asyncio", False),
        ("0", "uvloop", False),
        ("1", "asyncio", True),
        ("yes", "asyncio", "expected 0 or 1"),
        ("1", "uvloop", "gates asyncio's loop"),
    ],
)
def test_the_setting(
    monkeypatch: pytest.MonkeyPatch, value: str | None, event_loop: str, answer: bool | str
) -> None:
    if value is None:
        monkeypatch.delenv(loop_gate.ENV, raising=False)
    else:
        monkeypatch.setenv(loop_gate.ENV, value)
    if isinstance(answer, str):
        with pytest.raises(ValueError, match=answer):
            loop_gate.requested(event_loop)
    else:
        assert loop_gate.requested(event_loop) is answer


def test_a_bad_setting_stops_a_worker_before_it_binds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from pdserve.config import EngineConfig, ModelSpec, ServerConfig
    from pdserve.worker import process

    def no_bind(host: str, port: int) -> object:
        raise AssertionError("bound before the settings were checked")

    monkeypatch.setattr(process, "bind", no_bind)
    monkeypatch.setenv(loop_gate.ENV, "yes")
    spec = ModelSpec(path=str(tmp_path / "none"), name="none")
    assert process.run_server(ServerConfig(engine=EngineConfig(model=spec))) == 2
    assert "expected 0 or 1" in caplog.text


def test_a_gpu_worker_installs_it_and_releases_it_when_the_engine_dies(
    monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    """The wiring, off a GPU: the server hands the gate to its engine, whose thread claims it
    (and gpu_wait's waits on that thread open it); a fatal error opens it for good."""
    import torch

    from pdserve.config import EngineConfig, ModelSpec, ServerConfig
    from pdserve.worker.process import Server

    monkeypatch.setenv(loop_gate.ENV, "1")
    monkeypatch.setenv("PDSERVE_EVENT_LOOP", "asyncio")
    server = Server(ServerConfig(engine=EngineConfig(model=ModelSpec(str(tiny_dir), "tiny"))))
    assert server.install_loop_gate() is None  # its engine is on the CPU
    monkeypatch.setattr(server.host.engine.pool, "device", torch.device("cuda"))
    gate = server.install_loop_gate()
    assert gate is not None and server.host.engine.loop_gate is gate
    assert b"pdserve_loop_gate_turns_total" in server.host.engine.metrics.render()
    try:
        server.host.engine.tick()  # idle: claims it, and its wait for the inbox opened it
        assert gate.owner == threading.get_ident() and not gate.wait_turn(0)
        e = Watched(gate, 2)
        gpu_wait.wait_event(e, "a step")  # this (the engine's) thread's GPU waits open it
        assert e.open_at_query == [False, True, True]
        server._on_fatal("the engine thread died")
        assert gate.wait_turn(0) and gate.owner is None
        gate.claim()  # a tick after that cannot close it again
        assert gate.wait_turn(0)
    finally:
        gpu_wait.open_while_waiting(None)
        server.api.close()  # its tokenizer pool


def test_asyncios_loop_polls_with_the_selector_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """How a worker's loop gets its GatedSelector (runtime/evloop.py)."""
    from pdserve.runtime import evloop

    made: list[selectors.BaseSelector] = []

    def selector() -> selectors.BaseSelector:
        made.append(selectors.DefaultSelector())
        return made[-1]

    async def its_selector() -> object:
        return getattr(asyncio.get_running_loop(), "_selector", None)

    monkeypatch.setenv(evloop.ENV, "asyncio")
    assert evloop.run(its_selector(), selector=selector) is made[0]


def test_its_turns_are_counted_on_metrics() -> None:
    """Whether the loop's turns started while the engine waited or at their bound, and how
    long they waited: what a served run reads to tell whether the gate does its job."""
    from prometheus_client import CollectorRegistry, generate_latest

    gate = LoopGate()
    gate.claim()
    assert not gate.wait_turn(0.001)  # the engine never waited: the bound
    with gate.waiting():
        assert gate.wait_turn(0.001)
    registry = CollectorRegistry()
    gate.register(registry)
    lines = generate_latest(registry).decode().splitlines()
    assert 'pdserve_loop_gate_turns_total{start="engine_waiting"} 1.0' in lines
    assert 'pdserve_loop_gate_turns_total{start="bound"} 1.0' in lines
    waited = [x for x in lines if x.startswith("pdserve_loop_gate_wait_seconds_total ")]
    assert len(waited) == 1 and float(waited[0].split()[1]) >= 0.001
