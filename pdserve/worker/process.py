"""The co-located server process: engine thread + supervisor + aiohttp API.

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
from typing import Any

import torch
from aiohttp import web

from pdserve.config import ServerConfig
from pdserve.frontend.api import OpenAIApi, error_response, prompt_char_bound, read_json
from pdserve.frontend.protocol import ApiError
from pdserve.model.tokenizer import Tokenizer
from pdserve.runtime import evloop
from pdserve.runtime.gc_freeze import freeze_startup_heap
from pdserve.runtime.ready import announce_ready
from pdserve.runtime.supervisor import Supervisor
from pdserve.runtime.timing import (
    ABORT_GRACE_S,
    DRAIN_S,
    HANDLERS_STOP_S,
    THREADS_STOP_S,
)
from pdserve.server.admission import Admission
from pdserve.server.auth import Gate
from pdserve.server.body import app_args as body_app_args
from pdserve.server.errors import error_middleware
from pdserve.server.listener import Listener, bind, bind_error
from pdserve.server.stopping import Stop, in_thread
from pdserve.worker.api import WorkerApi
from pdserve.worker.engine_client import CLOSE_TIMEOUT_S, EngineClient, EngineStartFailed
from pdserve.worker.engine_host import LocalEngine, require_key

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
        )
        self.worker_api = WorkerApi(engine, cfg.role, cfg.engine.model.name, self.host.info)
        self.admission = Admission(cfg.max_queue)
        self.started = time.monotonic()

    def _on_fatal(self, why: str) -> None:
        self.fatal = why
        loop, stop = getattr(self, "_loop", None), self._stop
        if loop is not None and stop is not None:
            loop.call_soon_threadsafe(stop.request, f"fatal: {why}")

    # -- endpoints ------------------------------------------------------------------------
    def problems(self) -> list[str]:
        return self.supervisor.problems() + self.host.problems()

    async def health(self, request: web.Request) -> web.Response:
        problems = self.problems()
        return web.json_response(
            {"status": "ok" if not problems else "unhealthy", "problems": problems},
            status=200 if not problems else 503,
        )

    async def metrics(self, request: web.Request) -> web.Response:
        try:
            body = await self.host.metrics_text()
        except (TimeoutError, ConnectionError) as e:
            return web.json_response({"error": f"the engine did not answer: {e}"}, status=503)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def debug_state(self, request: web.Request) -> web.Response:
        state: dict[str, Any] = {
            "role": self.cfg.role,
            "model": self.cfg.engine.model.name,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "threads": self.supervisor.snapshot(),
            "problems": self.problems(),
            "http": self.listener.snapshot() if self.listener is not None else None,
            "output_channels": self.worker_api.channels.snapshot(),
        }
        try:
            state["engine"], engine_threads = await self.host.state()
            state["threads"] += engine_threads  # the engine process's, if it has its own
        except (TimeoutError, ConnectionError):
            state["engine"] = {"error": "the engine thread did not answer within 2 s"}
        return web.json_response(state)

    async def debug_invariants(self, request: web.Request) -> web.Response:
        """At quiescence: no live request, every page free, every thread alive and fresh. At any
        time: every page's reference count equals the number of live leases holding it."""
        try:
            eng, _ = await self.host.state()
        except (TimeoutError, ConnectionError):
            return web.json_response({"ok": False, "violations": ["engine not answering"]})
        violations = list(self.problems())
        pool = eng["pool"]
        if eng["requests"]:
            violations.append(f"{len(eng['requests'])} requests still live")
        role = eng.get("role") or {}
        if role.get("rooms"):
            violations.append(f"{len(role['rooms'])} transfer rooms still open")
        if role.get("admitting"):
            violations.append(f"{role['admitting']} requests still waiting for pages")
        idle = pool["pages_free"] + pool.get("pages_cached", 0)  # cached pages are evictable
        if idle != pool["pages_total"]:
            violations.append(
                f"pages free {pool['pages_free']} + cached {pool.get('pages_cached', 0)} "
                f"!= total {pool['pages_total']}"
            )
        if pool["leases"]:
            violations.append(f"{pool['leases']} page leases still live")
        violations += [f"lease check: {v}" for v in pool["lease_violations"]]
        # KV bytes are conserved: nothing is reported (P) or decoded on (D) that was not
        # written (P) or received (D, when the pages pass through it: tcp, nixl).
        stats = role.get("stats") or {}
        if self.cfg.role == "prefill" or role.get("counts_bytes"):
            acked, written = stats.get("bytes_acked", 0), stats.get("bytes_written", 0)
            if acked > written:
                violations.append(f"KV bytes acknowledged {acked} > written/received {written}")
        return web.json_response({"ok": not violations, "violations": violations, "pool": pool})

    async def debug_faults(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(await self.host.faults())
        except (TimeoutError, ConnectionError) as e:
            return web.json_response({"error": f"the engine did not answer: {e}"}, status=503)

    async def set_faults(self, request: web.Request) -> web.Response:
        """{"spec": "point=action...", "seed": 0} replaces every fault point; "" clears them."""
        if not self.cfg.debug_faults:
            return error_response(
                ApiError(
                    403,
                    "fault points cannot be set on this server: start it with --debug-faults",
                    code="debug_faults_off",
                )
            )
        try:
            body = await read_json(request)
        except ApiError as e:
            return error_response(ApiError(400, e.message, param=e.param, code="bad_json"))
        spec = body.get("spec") if isinstance(body, dict) else None
        seed = body.get("seed", 0) if isinstance(body, dict) else None
        if not isinstance(spec, str) or not isinstance(seed, int) or isinstance(seed, bool):
            return error_response(
                ApiError(400, 'expected {"spec": str, "seed": int}', code="bad_fault_request")
            )
        try:
            return web.json_response(await self.host.faults(spec, seed))
        except ValueError as e:
            return error_response(ApiError(400, str(e), param="spec", code="bad_fault_spec"))
        except (TimeoutError, ConnectionError) as e:
            return web.json_response({"error": f"the engine did not answer: {e}"}, status=503)

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
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
                web.get("/debug/state", self.debug_state),
                web.get("/debug/invariants", self.debug_invariants),
                web.get("/debug/faults", self.debug_faults),
                web.post("/debug/faults", self.set_faults),
            ]
        )
        return app

    # -- lifecycle ------------------------------------------------------------------------
    async def serve(self, listener: Listener, drain_timeout_s: float = DRAIN_S) -> int:
        """Serve on `listener`'s bound sockets until stopped; the exit status."""
        self._loop = asyncio.get_running_loop()
        stop = self._stop = Stop()
        stop.install(self._loop)
        self.listener = listener
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
        stuck = await stop.unless_forced(self.host.close(stuck), CLOSE_TIMEOUT_S)
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
