"""The worker's side of its engine process (`serve --engine-process`): `EngineClient`.

`EngineClient` starts the engine process (worker/host/process.py), waits for it to be built
(`Ready`), and from then on stands for the engine: the APIs call `validate`, `submit` and
`abort` on it as on an `Engine`, and the server reads health, pending work, the snapshot,
the metrics and the fault points through it (the `EngineHost` surface, worker/host/local_engine.py).

Everything after `Ready` runs on the worker's event loop: the socket is read by a reader
callback (`loop.add_reader`), so a tick's outputs reach their sinks in one loop turn with no
thread of ours between the engine and the loop; frames down are sent from the loop, and what
the socket does not take at once waits for it to become writable, never blocking the loop.
Requests validate here with the engine's own rule (its `max_model_len` and `vocab_size`, from
Ready), so a refused one never crosses.

The engine process's death, a garbled frame or its `Fatal` is the worker's fatal error
(`on_fatal`): every request still live here ends with an error first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pdserve.config import EngineConfig, ServerConfig
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams, validate_prompt
from pdserve.runtime.timing import (
    ENGINE_EXIT_TIMEOUT_S,
    ENGINE_START_TIMEOUT_S,
    ENGINE_STATUS_STALE_S,
    ENGINE_STOP_TIMEOUT_S,
)
from pdserve.server.stopping import in_thread
from pdserve.worker.host import frames as f

log = logging.getLogger(__name__)

MAX_BACKLOG = 64 * 2**20  # bytes the engine process has not read: past this it is not reading
RECV_BYTES = 1 << 20
RECVS_PER_TURN = 8  # then the loop's other callbacks run


class EngineStartFailed(RuntimeError):
    """The engine process exited, or sent nothing usable, before Ready; `code` its status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


Sink = Callable[[RequestOutput], None]


class EngineClient:
    def __init__(self, cfg: ServerConfig, eos_token_ids: frozenset[int], threads: int) -> None:
        self.cfg: EngineConfig = cfg.engine
        self.hard_exit = False  # the engine process leaves its own way
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = ours
        argv = [sys.executable, "-m", "pdserve.worker.host.process"]
        argv += ["--fd", str(theirs.fileno()), "--parent", str(os.getpid())]
        self.proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        setup = f.Setup(replace(cfg, api_key=None), sorted(eos_token_ids), threads, level)
        self._frames = f.Frames(up=True)
        try:
            ours.sendall(f.encode(setup))
            ready, self._early = self._wait_ready()
        except BaseException:
            self.kill()
            raise
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.info: dict[str, Any] = {**ready.info, "pid": os.getpid(), "engine_pid": ready.pid}
        self._sinks: dict[str, Sink] = {}
        self._queries: dict[int, asyncio.Future[Any]] = {}
        self._next_qid = 0
        self._status = f.Status([], False)
        self._status_at = time.monotonic()
        self._stopped: asyncio.Future[list[str] | None] | None = None
        self._backlog = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._on_fatal: Callable[[str], None] = lambda why: None
        self.failed: str | None = None  # the link is lost
        self.refusing: str | None = None  # a Fatal came: nothing new is sent to the engine

    def _wait_ready(self) -> tuple[f.Ready, list[Any]]:
        """Ready, and the frames that came with it (handled once attached)."""
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if not select.select([self._sock], [], [], 1.0)[0]:
                if self.proc.poll() is not None:
                    break
                continue
            data = self._sock.recv(RECV_BYTES)
            if not data:
                break
            got = self._frames.feed(data)
            for i, frame in enumerate(got):
                if isinstance(frame, f.Ready):
                    return frame, got[i + 1 :]
                if not isinstance(frame, f.Status):
                    raise EngineStartFailed(f"the engine process sent {frame!r} first", 1)
        else:
            raise EngineStartFailed(
                f"the engine was not ready within {ENGINE_START_TIMEOUT_S:.0f}s", 1
            )
        try:
            code = self.proc.wait(ENGINE_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = 1
        # A signal's death (negative) exits the worker as a shell reports it: 128 + signal.
        raise EngineStartFailed(
            f"the engine process exited with status {code}", 128 - code if code < 0 else code or 1
        )

    @property
    def frontend(self) -> EngineClient:
        return self

    # -- the engine's surface for the APIs (on the loop) ------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_ids, params, self.vocab_size, self.max_model_len)

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        timeout_s: float | None = None,
        prefill: str | None = None,
    ) -> None:
        self.validate(prompt_ids, params)
        loop = self._loop
        assert loop is not None, "submit before attach"
        down = self.failed or self.refusing
        if down is not None or request_id in self._sinks:
            why = (
                f"the engine process failed: {down}"
                if down is not None
                else f"duplicate request id {request_id}"
            )
            loop.call_soon(sink, RequestOutput(request_id, (), (), "error", why))
            return
        data = f.encode(f.Submit(request_id, list(prompt_ids), params, timeout_s, prefill))
        self._sinks[request_id] = sink
        self._send_bytes(data)

    def abort(self, request_id: str) -> None:
        self._send(f.AbortRequest(request_id))

    # -- the server's surface ----------------------------------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop, on_fatal: Callable[[str], None]) -> None:
        """From now on the socket is read and written on `loop` (its own thread)."""
        self._loop, self._loop_thread, self._on_fatal = loop, threading.get_ident(), on_fatal
        self._sock.setblocking(False)
        loop.add_reader(self._sock.fileno(), self._readable)
        early, self._early = self._early, []
        for frame in early:  # what came with Ready
            self._handle(frame)

    def problems(self) -> list[str]:
        if self.failed is not None:
            return [f"the engine process failed: {self.failed}"]
        out = list(self._status.problems)
        age = time.monotonic() - self._status_at
        if age > ENGINE_STATUS_STALE_S:
            out.append(f"the engine process has not reported for {age:.1f}s")
        return out

    def has_work(self) -> bool:
        return bool(self._sinks) or self._status.has_work

    async def state(self) -> tuple[dict[str, Any], list[dict[str, object]]]:
        value = await self._query(f.Query(self._qid(), "state", 2.0), 2.0)
        return value["engine"], value["threads"]

    async def metrics_text(self) -> bytes:
        value = await self._query(f.Query(self._qid(), "metrics", 2.0), 2.0)
        if not isinstance(value, bytes):
            raise TypeError(f"metrics came as {type(value).__name__}")
        return value

    async def faults(self, spec: str | None = None, seed: int = 0) -> dict[str, object]:
        qid = self._qid()
        frame: f.Query | f.SetFaults = (
            f.Query(qid, "faults", 2.0) if spec is None else f.SetFaults(qid, spec, seed)
        )
        return dict(await self._query(frame, 2.0))

    async def close(self, stuck: list[str] | None) -> list[str] | None:
        """After the worker's threads (`stuck`: those that did not stop): the engine process
        stopped; every thread of both that did not stop in time (None: unknown)."""
        engine_stuck = await self.stop()
        return None if stuck is None or engine_stuck is None else stuck + engine_stuck

    async def stop(self) -> list[str] | None:
        """Stop the engine process: its threads' names that did not stop in time (None: it
        did not answer, or had failed). Waits for it to exit, and kills it if it does not."""
        loop = asyncio.get_running_loop()
        stuck: list[str] | None = None
        if self.failed is None:
            self._stopped = loop.create_future()
            self._send(f.Stop())
            try:
                async with asyncio.timeout(ENGINE_STOP_TIMEOUT_S):
                    stuck = await self._stopped
            except (TimeoutError, ConnectionError) as e:
                log.error("the engine process did not stop: %s", e or "no answer in time")
        self._close_link()
        try:  # a daemon thread: a second signal's stop-now need not wait for it
            code = await in_thread(lambda: self.proc.wait(ENGINE_EXIT_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            log.error("the engine process (pid %d) did not exit: killing it", self.proc.pid)
            await in_thread(self.kill)
            return None
        if code != 0:
            log.error("the engine process exited with status %d", code)
        return stuck

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(ENGINE_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.error("the engine process (pid %d) outlived SIGKILL", self.proc.pid)

    # -- the link ------------------------------------------------------------------------------
    def _qid(self) -> int:
        self._next_qid += 1
        return self._next_qid

    async def _query(self, frame: f.Query | f.SetFaults, timeout_s: float) -> Any:
        if self.failed is not None:
            raise TimeoutError(f"the engine process failed: {self.failed}")
        assert self._loop is not None
        fut = self._queries[frame.qid] = self._loop.create_future()
        self._send(frame)
        try:
            async with asyncio.timeout(timeout_s):
                return await fut
        except TimeoutError:
            raise TimeoutError(f"the engine process did not answer in {timeout_s:.0f}s") from None
        finally:
            self._queries.pop(frame.qid, None)

    def _send(self, frame: f.Frame) -> None:
        self._send_bytes(f.encode(frame))

    def _send_bytes(self, data: bytes) -> None:
        loop = self._loop
        assert loop is not None, "a frame before attach"
        if threading.get_ident() != self._loop_thread:  # e.g. an abort from another thread
            loop.call_soon_threadsafe(self._send_bytes, data)
            return
        if self.failed is not None:
            return
        if self._backlog:
            self._backlog += data
        else:
            try:
                sent = self._sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError as e:
                self._fail(f"the link failed: {type(e).__name__}: {e}")
                return
            if sent == len(data):
                return
            self._backlog += data[sent:]
            loop.add_writer(self._sock.fileno(), self._writable)
        if len(self._backlog) > MAX_BACKLOG:
            self._fail(f"it has not read {len(self._backlog)} bytes sent to it")

    def _writable(self) -> None:
        try:
            sent = self._sock.send(self._backlog)
        except BlockingIOError:
            return
        except OSError as e:
            self._fail(f"the link failed: {type(e).__name__}: {e}")
            return
        del self._backlog[:sent]
        if not self._backlog and self._loop is not None:
            self._loop.remove_writer(self._sock.fileno())

    def _readable(self) -> None:
        for _ in range(RECVS_PER_TURN):
            try:
                data = self._sock.recv(RECV_BYTES)
            except BlockingIOError:
                return
            except OSError as e:
                self._fail(f"the link failed: {type(e).__name__}: {e}")
                return
            if not data:
                self._fail("it closed the link (exited?)")
                return
            for frame in self._frames.feed(data):
                self._handle(frame)
                if self.failed is not None:
                    return

    def _handle(self, frame: Any) -> None:
        match frame:
            case f.Outputs():
                for out in frame.outputs:
                    sink = self._sinks.get(out.request_id)  # the link may fail meanwhile
                    if sink is None:
                        continue  # ended here already
                    if out.finish_reason is not None:
                        del self._sinks[out.request_id]
                    try:
                        sink(out)
                    except Exception:  # noqa: BLE001 - one stream's bug costs only it
                        log.exception("delivering an output of %s failed", out.request_id)
            case f.Status():
                self._status, self._status_at = frame, time.monotonic()
            case f.Reply():
                fut = self._queries.get(frame.qid)
                if fut is not None and not fut.done():
                    if frame.error is None:
                        fut.set_result(frame.value)
                    else:
                        fut.set_exception(ValueError(frame.error))
            case f.Fatal():  # its requests will hear nothing more: they end here, now
                self.refusing = frame.why
                self._end_requests(f"the engine process failed: {frame.why}")
                self._on_fatal(f"the engine process: {frame.why}")
            case f.Stopped():
                if self._stopped is not None and not self._stopped.done():
                    self._stopped.set_result(frame.stuck)
            case _:
                self._fail(f"it sent a frame out of place: {frame!r}")

    def _fail(self, why: str) -> None:
        """The link is lost: every live request ends with an error, then the worker's fatal
        error (unless it is stopping the engine process itself)."""
        if self.failed is not None:
            return
        self.failed = why
        self._close_link()
        error = f"the engine process failed: {why}"
        self._end_requests(error)
        for fut in self._queries.values():
            if not fut.done():
                fut.set_exception(ConnectionError(error))
        stopping = self._stopped is not None
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_exception(ConnectionError(error))
        if not stopping:
            log.error("%s", error)
            self._on_fatal(error)

    def _end_requests(self, error: str) -> None:
        """Every request live here ends with `error`; the engine's later outputs are dropped."""
        sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            try:
                sink(RequestOutput(rid, (), (), "error", error))
            except Exception:  # noqa: BLE001 - the others still end
                log.exception("ending %s failed", rid)

    def _close_link(self) -> None:
        loop = self._loop
        if loop is not None and self._sock.fileno() >= 0:
            loop.remove_reader(self._sock.fileno())
            loop.remove_writer(self._sock.fileno())
        self._sock.close()
