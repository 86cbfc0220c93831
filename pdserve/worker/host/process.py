"""The engine process: a worker's engine, role and threads, in a process apart from its event loop.

Why: in one process the engine thread and the worker's event loop share one GIL, and the
loop's turns (HTTP, the output streams) land inside the engine's tick, so at high concurrency
the served inter-token gap grows well past the engine's own step (docs/architecture.md
§Engine process; benchmarks/RESULTS.md, 2026-12-05 c and f). Here the engine thread shares
the GIL only with this process's control and data-plane threads and the main thread, which
reads the worker's frames.

Started by `EngineClient` (worker/host/client.py) as

    python -m pdserve.worker.host.process --fd FD --parent PID

with one end of a socketpair as FD. The first frame down is Setup; this process builds
`LocalEngine` from it (the model loads here, on this process's GPU), starts the engine, control
and data-plane threads under its own supervisor, and answers Ready. Then its main thread reads
Submit, AbortRequest, Query and SetFaults frames, and sends a Status every ENGINE_STATUS_EVERY_S;
the engine thread sends each tick's outputs as one Outputs frame. Stop, or the worker closing
the socket, stops the threads and ends the process. It dies with the worker: SIGKILL when the
worker process dies (PR_SET_PDEATHSIG), and it ignores SIGINT and SIGTERM, which a terminal or
a process group sends to both: the worker decides when the engine stops.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

from pdserve.engine.commands import SnapshotQuery
from pdserve.protocol.outputs import RequestOutput
from pdserve.runtime import logs
from pdserve.runtime.child import die_with_parent
from pdserve.runtime.gc_freeze import freeze_startup_heap
from pdserve.runtime.supervisor import Supervisor
from pdserve.runtime.timing import (
    ENGINE_SEND_TIMEOUT_S,
    ENGINE_SETUP_TIMEOUT_S,
    ENGINE_STATUS_EVERY_S,
    THREADS_STOP_S,
)
from pdserve.worker.host import frames as f
from pdserve.worker.host.local_engine import LocalEngine

log = logging.getLogger(__name__)

RECV_BYTES = 1 << 20
OUTPUTS_FRAME_BYTES = 16 * 2**20  # a tick's outputs are split into frames of about this


class Uplink:
    """Frames to the worker from any thread of this process; `collect` is every request's
    sink, and `flush` sends what the engine emitted since the last one, in frames of at most
    OUTPUTS_FRAME_BYTES where it can.

    A send that fails (the worker gone, or not reading for ENGINE_SEND_TIMEOUT_S) may have left part
    of a frame on the socket, after which nothing can be read again: the link is then shut
    down for good, the worker sees its end (its fatal error, every live request ended with an
    error there), and every later send raises at once."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()
        self._out_lock = threading.Lock()
        self._outputs: list[RequestOutput] = []
        self.broken: str | None = None

    def send(self, frame: f.Frame) -> None:
        self._send_bytes(f.encode(frame))

    def _send_bytes(self, data: bytes) -> None:
        with self._send_lock:
            if self.broken is not None:
                raise ConnectionError(f"the link to the worker is down: {self.broken}")
            try:
                self._sock.sendall(data)
            except OSError as e:
                self.broken = f"{type(e).__name__}: {e}"
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already gone
                raise

    def collect(self, out: RequestOutput) -> None:
        with self._out_lock:
            self._outputs.append(out)

    def flush(self) -> None:
        with self._out_lock:
            outputs, self._outputs = self._outputs, []
        if outputs:
            self._send_outputs(outputs)

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        """One frame, or halves of the list until each fits (a tick's outputs are small; a
        first output with the prompt's logprobs of a long prompt is not: ~320 bytes a token
        at 20 alternatives). A single output over the worker's frame limit cannot be sent."""
        data = f.encode(f.Outputs(outputs))
        if len(data) > OUTPUTS_FRAME_BYTES and len(outputs) > 1:
            half = len(outputs) // 2
            self._send_outputs(outputs[:half])
            self._send_outputs(outputs[half:])
            return
        self._send_bytes(data)


def _read_setup(sock: socket.socket, frames: f.Frames) -> f.Setup:
    deadline = time.monotonic() + ENGINE_SETUP_TIMEOUT_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            raise TimeoutError(
                f"no Setup frame from the worker within {ENGINE_SETUP_TIMEOUT_S:.0f}s"
            )
        data = sock.recv(RECV_BYTES)
        if not data:
            raise ConnectionError("the worker closed the link before its Setup")
        got = frames.feed(data)
        if got:
            if not isinstance(got[0], f.Setup) or len(got) > 1:
                raise ConnectionError(f"expected one Setup frame first, got {got[0]!r}")
            return got[0]


class EngineProcess:
    """The main thread's loop: frames from the worker in, Status out, until Stop."""

    def __init__(self, sock: socket.socket, host: LocalEngine, uplink: Uplink) -> None:
        self.sock = sock
        self.host = host
        self.uplink = uplink
        self.supervisor = Supervisor(on_fatal=self._on_fatal)

    def _on_fatal(self, why: str) -> None:
        try:
            self.uplink.send(f.Fatal(why))
        except OSError as e:  # the worker is gone: it cannot be told
            log.error("could not tell the worker of a fatal error (%s): %s", e, why)

    def status(self) -> f.Status:
        return f.Status(self.supervisor.problems() + self.host.problems(), self.host.has_work())

    def run(self, frames: f.Frames) -> str:
        """Until Stop (returns "stop") or the link is lost (returns why)."""
        next_status = 0.0
        while True:
            now = time.monotonic()
            if now >= next_status:
                self.uplink.send(self.status())
                next_status = now + ENGINE_STATUS_EVERY_S
            if not select.select([self.sock], [], [], max(0.0, next_status - now))[0]:
                continue
            data = self.sock.recv(RECV_BYTES)
            if not data:
                return "the worker closed the link"
            for frame in frames.feed(data):
                if isinstance(frame, f.Stop):
                    return "stop"
                if isinstance(frame, f.Garbled | f.Setup):
                    return f"a frame out of place from the worker: {frame!r}"
                self.handle(frame)

    def handle(self, frame: Any) -> None:
        engine = self.host.engine
        match frame:
            case f.Submit():
                try:
                    engine.submit(
                        frame.request_id,
                        frame.prompt_ids,
                        frame.params,
                        self.uplink.collect,
                        frame.timeout_s,
                        prefill=frame.prefill,
                    )
                except Exception as e:  # noqa: BLE001 - the worker checked it; end it, say why
                    error = f"could not submit: {type(e).__name__}: {e}"
                    self.uplink.send(
                        f.Outputs([RequestOutput(frame.request_id, (), (), "error", error)])
                    )
            case f.AbortRequest():
                engine.abort(frame.request_id)
            case f.Query(what="state"):
                self._answer_state(frame.qid)
            case f.Query(what="metrics"):
                self.uplink.send(f.Reply(frame.qid, self.host.metrics_bytes()))
            case f.Query(what="faults"):
                self.uplink.send(f.Reply(frame.qid, self.host.set_faults(None, 0)))
            case f.SetFaults():
                try:
                    value = self.host.set_faults(frame.spec, frame.seed)
                except ValueError as e:
                    self.uplink.send(f.Reply(frame.qid, None, str(e)))
                else:
                    self.uplink.send(f.Reply(frame.qid, value))
            case _:
                self.uplink.send(f.Reply(getattr(frame, "qid", -1), None, f"unknown {frame!r}"))

    def _answer_state(self, qid: int) -> None:
        """The engine thread answers; the worker times the wait (a wedged engine never does)."""
        fut: Future[dict[str, Any]] = Future()
        threads = self.supervisor.snapshot()

        def answer(done: Future[dict[str, Any]]) -> None:
            self.uplink.send(f.Reply(qid, {"engine": done.result(), "threads": threads}))

        fut.add_done_callback(answer)
        self.host.engine.inbox.put(SnapshotQuery(fut))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve.worker.host.process")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    args = p.parse_args(argv)
    die_with_parent(args.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    sock.set_inheritable(False)  # a process started from here must not hold the link open
    frames = f.Frames(up=False)
    setup = _read_setup(sock, frames)
    logs.setup(setup.log_level)
    if setup.threads:
        import torch

        torch.set_num_threads(setup.threads)
    try:
        host = LocalEngine(setup.server, frozenset(setup.eos_token_ids))
    except Exception as e:  # noqa: BLE001 - the worker exits with our status, we say why
        log.error("the engine could not be built: %s: %s", type(e).__name__, e)
        from pdserve.transfer.nixl import BackendUnavailable

        return 2 if isinstance(e, BackendUnavailable) else 1
    uplink = Uplink(sock)
    proc = EngineProcess(sock, host, uplink)
    host.start(proc.supervisor, after_tick=uplink.flush)
    sock.settimeout(ENGINE_SEND_TIMEOUT_S)  # sends; the reads below wait in select
    engine = host.engine
    uplink.send(f.Ready(host.info, engine.max_model_len, engine.vocab_size, os.getpid()))
    freeze_startup_heap()  # as the worker does: no full GC pass over the model mid-decode
    code = 1
    try:
        try:
            why = proc.run(frames)
        except Exception as e:  # noqa: BLE001 - the link, or a bug here: stop in order
            why = f"the link failed: {type(e).__name__}: {e}"
        if why != "stop":
            log.error("stopping: %s", why)
        stuck = proc.supervisor.stop(timeout_s=THREADS_STOP_S)
        if stuck:
            log.error("threads did not stop in time: %s", stuck)
        host.close_now(stuck)
        try:
            uplink.send(f.Stopped(stuck))
        except OSError:
            pass  # the worker is gone
        code = 0 if why == "stop" and not stuck else 1
    finally:
        if host.hard_exit:  # worker/server.py run_server says why; also after a raise here
            logging.shutdown()
            os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
