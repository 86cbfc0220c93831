"""A worker process (co-located, prefill or decode): its engine, its HTTP app, its lifecycle.

`Server` builds the engine host (in this process, or the engine process: worker/host/), the
OpenAI API (a co-located worker), the worker API (worker/http/api.py) and the operator
endpoints (worker/http/ops.py), and runs them on one event loop.

Lifecycle: bind (before the model loads: a busy port is exit status 2 at once) -> startup
(load, warm up) -> serve (listen, READY) -> drain (stop accepting, let requests finish for at
most DRAIN_S) -> stop (end the rest, stop threads with a timeout). A second SIGINT/SIGTERM
during any of it stops at once (server/stopping.py). A supervised thread that dies for good
triggers the same shutdown with a non-zero exit code. HTTP limits: server/listener.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from pathlib import Path

import torch
from aiohttp import web

from pdserve.config import ServerConfig
from pdserve.frontend.api import OpenAIApi, prompt_char_bound
from pdserve.model.tokenizer import Tokenizer
from pdserve.runtime import evloop
from pdserve.runtime.gc_freeze import freeze_startup_heap
from pdserve.runtime.ready import announce_ready
from pdserve.runtime.supervisor import Supervisor
from pdserve.runtime.timing import (
    ABORT_GRACE_S,
    DRAIN_S,
    ENGINE_CLOSE_TIMEOUT_S,
    HANDLERS_STOP_S,
    THREADS_STOP_S,
)
from pdserve.server.admission import Admission
from pdserve.server.auth import Gate
from pdserve.server.body import app_args as body_app_args
from pdserve.server.errors import error_middleware
from pdserve.server.listener import Listener, bind, bind_error
from pdserve.server.stopping import Stop, in_thread
from pdserve.worker.host.client import EngineClient, EngineStartFailed
from pdserve.worker.host.local_engine import LocalEngine, require_key
from pdserve.worker.http.api import WorkerApi
from pdserve.worker.http.ops import OpsApi

log = logging.getLogger(__name__)

# A worker's event loop by default: with the engine in the worker it shares the GIL with the
# engine thread (runtime/evloop.py says why; a worker with an engine process keeps it too).
WORKER_LOOP = "asyncio"


class Server:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.fatal: str | None = None
        self._stop: Stop | None = None
        self.forced = False  # a second signal stopped the process without draining
        self.listener: Listener | None = None
        self.supervisor = Supervisor(on_fatal=self._on_fatal)
        # First, before any model is loaded: a worker without its key cannot serve.
        self.key = require_key(cfg)
        self.tokenizer = Tokenizer.from_dir(Path(cfg.engine.model.path))
        eos = self.tokenizer.eos_token_ids
        self.host: LocalEngine | EngineClient
        if cfg.engine_process:  # the model loads there; this waits until it is ready
            self.host = EngineClient(cfg, eos, torch.get_num_threads())
        else:
            self.host = LocalEngine(cfg, eos)
        engine = self.host.frontend
        self.api = OpenAIApi(
            engine,
            self.tokenizer,
            cfg.engine.model.name,
            engine.max_model_len,
            cfg.engine.request_timeout_s,
            prompt_char_bound(self.tokenizer.max_token_chars, engine.max_model_len),
            cfg.frontend,
        )
        self.worker_api = WorkerApi(engine, cfg.role, cfg.engine.model.name, self.host.info)
        self.admission = Admission(cfg.max_queue)
        started = time.monotonic()
        self.ops = OpsApi(
            cfg,
            self.supervisor,
            self.host,
            self.worker_api.channels,
            lambda: time.monotonic() - started,
        )

    def _on_fatal(self, why: str) -> None:
        self.fatal = why
        loop, stop = getattr(self, "_loop", None), self._stop
        if loop is not None and stop is not None:
            loop.call_soon_threadsafe(stop.request, f"fatal: {why}")

    def app(self, listener: Listener | None = None) -> web.Application:
        # The listener's middleware is the outermost (a connection is busy for all of a
        # request), then the error middleware: a 401 passes through it unchanged.
        gate = Gate(self.cfg.api_key, self.key, self.cfg.protect_health)
        middlewares = [error_middleware(), gate.middleware(), self.admission.middleware()]
        if listener is not None:
            middlewares.insert(0, listener.middleware())
        app = web.Application(middlewares=middlewares, **body_app_args(self.api.max_body_bytes))
        if self.cfg.role == "colocated":
            app.add_routes(self.api.routes())
        if self.cfg.role != "prefill":
            app.add_routes(self.worker_api.routes())
        else:
            app.add_routes([r for r in self.worker_api.routes() if r.path == "/info"])
        app.add_routes(self.ops.routes())
        return app

    # -- lifecycle ------------------------------------------------------------------------
    async def serve(self, listener: Listener, drain_timeout_s: float = DRAIN_S) -> int:
        """Serve on `listener`'s bound sockets until stopped; the exit status."""
        self._loop = asyncio.get_running_loop()
        stop = self._stop = Stop()
        stop.install(self._loop)
        self.listener = self.ops.listener = listener
        if isinstance(self.host, EngineClient):
            self.host.attach(self._loop, self._on_fatal)
        else:
            self.host.start(self.supervisor)
        runner = await listener.serve(self.app(listener))
        url = f"http://{self.cfg.host}:{listener.port}"
        freeze_startup_heap()  # no full GC pass over the model and libraries while serving
        if self.fatal is None:  # never announce a process that is already dying
            announce_ready(url)
        log.info("serving %s on %s", self.cfg.engine.model.name, url)
        await stop.requested.wait()
        await self._drain(listener, stop, drain_timeout_s)
        if not stop.forced.is_set():
            await stop.unless_forced(runner.cleanup(), HANDLERS_STOP_S + 2.0)
        self.api.close()
        stuck = None
        if not stop.forced.is_set():
            stuck = await stop.unless_forced(
                in_thread(lambda: self.supervisor.stop(timeout_s=THREADS_STOP_S)),
                THREADS_STOP_S + 1.0,
            )
        code = stop.exit_code
        if code is not None:  # forced: leave the threads and sockets to the process's end
            self.forced = True
            log.warning("stopped at once: %d connections dropped", len(listener.connections))
            return code
        # The engine process's threads stop now, behind this process's (it has none of them).
        stuck = await stop.unless_forced(self.host.close(stuck), ENGINE_CLOSE_TIMEOUT_S)
        if stop.exit_code is not None:
            self.forced = True
            return stop.exit_code
        if stuck is None or stuck:
            log.error("threads did not stop in time: %s", stuck or "the supervisor did not answer")
        return 1 if self.fatal or stuck is None or stuck else 0

    async def _drain(self, listener: Listener, stop: Stop, drain_timeout_s: float) -> None:
        """Stop accepting; let running requests finish for at most `drain_timeout_s`; then end
        the rest. A fatal error skips the wait: the process cannot be trusted to finish them."""
        listener.stop_accepting()
        self.admission.draining = True
        self.worker_api.channels.stop()  # an idle router channel must not hold the drain up
        if self.fatal is not None:
            log.info("shutting down (fatal: %s)", self.fatal)
            # Each router hears which of its requests ended here, and why, before the cut.
            self.worker_api.channels.fail_all(f"the worker failed: {self.fatal}")
            return
        log.info(
            "shutting down (%s): %d requests running, waiting at most %.0fs for them; "
            "signal again to stop at once",
            stop.reason,
            listener.busy,
            drain_timeout_s,
        )

        def idle() -> bool:
            return listener.busy == 0 and not self.host.has_work()

        if await stop.drain(idle, drain_timeout_s) or stop.forced.is_set():
            return
        busy = listener.busy
        choices = self.api.abort_all()
        carried = self.worker_api.channels.fail_all("the worker is shutting down")
        log.warning(
            "%d connections still busy after %.0fs: ending their requests (%d choices "
            "aborted, %d requests on router channels)",
            busy,
            drain_timeout_s,
            choices,
            carried,
        )
        await stop.drain(lambda: listener.busy == 0, ABORT_GRACE_S)


def run_server(cfg: ServerConfig) -> int:
    """Bind, load, serve: the process's exit status (2: the port cannot be had)."""
    try:
        sockets = bind(cfg.host, cfg.port)
    except OSError as e:
        log.error("%s", bind_error(cfg.host, cfg.port, e))
        return 2
    try:
        if cfg.role == "prefill" and cfg.control_port:
            _check_free(cfg.host, cfg.control_port)
    except OSError as e:
        log.error("%s", bind_error(cfg.host, cfg.control_port, e, flag="--control-port"))
        for s in sockets:
            s.close()
        return 2
    try:
        server = Server(cfg)
    except EngineStartFailed as e:  # it said why in the log we share
        log.error("%s", e)
        for s in sockets:
            s.close()
        return e.code
    except BaseException:
        for s in sockets:
            s.close()
        raise
    code = 1
    try:
        code = evloop.run(
            server.serve(Listener(sockets, cfg.http), cfg.drain_timeout_s),
            default=WORKER_LOOP,
        )
    except Exception:  # noqa: BLE001 - logged; the exit below must still happen
        log.exception("the server failed")
    sys.stdout.flush()
    if server.forced or server.host.hard_exit:
        # Forced: stop now, without joining threads (the engine may be mid-step). NIXL: do
        # not let the interpreter destroy the agent: UCX aborts the process (an assertion)
        # when it tears down an endpoint that still has requests queued for a peer that is
        # stopped. The orderly part of the shutdown is done; leave without that teardown.
        logging.shutdown()
        sys.stderr.flush()
        os._exit(code)
    return code


def _check_free(host: str, port: int) -> None:
    """Raise OSError if host:port cannot be bound now (the prefill control port, which ZMQ
    binds after the model loads)."""
    with socket.create_server((host, port)):
        pass
