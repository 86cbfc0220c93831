"""The router process: OpenAI API over a fleet of workers, plus health, metrics, debug.

Lifecycle: bind (before the tokenizer loads: a busy port is exit status 2 at once) ->
startup (discover the fleet, refuse a fleet that cannot work; start the health loop) ->
serve (listen, READY) -> drain (stop accepting; running requests may finish for at most
`drain_timeout_s`) -> stop (abort the rest on their workers, stop the health loop, close the
client session). A second SIGINT/SIGTERM stops at once (server/stopping.py). One aiohttp
ClientSession carries every call to every worker; each call has its own timeout, and its
pooled connections are dropped before a worker's idle timeout could close them under it.
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

import aiohttp
from aiohttp import web

from pdserve.frontend.api import OpenAIApi, prompt_char_bound
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling import validate_prompt
from pdserve.router.backend import RemoteBackend
from pdserve.router.client import WorkerClient, WorkerError
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import Fleet, discover
from pdserve.router.health import CANARY_PARAMS, HealthMonitor
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import PrefixSettings, make_policy
from pdserve.router.prefix_index import fleet_page_size
from pdserve.router.registry import Registry
from pdserve.runtime import evloop
from pdserve.runtime.cluster_key import ClusterKey
from pdserve.runtime.gc_freeze import freeze_startup_heap
from pdserve.runtime.ready import announce_ready
from pdserve.runtime.timing import HANDLERS_STOP_S, RETRY_AFTER_S, ROUTER_STOP_S
from pdserve.server.admission import Admission
from pdserve.server.auth import Gate
from pdserve.server.body import app_args as body_app_args
from pdserve.server.errors import error_middleware
from pdserve.server.listener import HttpLimits, Listener, bind, bind_error
from pdserve.server.stopping import Stop

log = logging.getLogger(__name__)

CANARY_TEXT = "The health check says:"
# Idle connections to workers are dropped this soon, well before a worker's own idle timeout
# closes them: a POST on a connection the worker is closing would fail, and is not retried.
WORKER_KEEPALIVE_S = HttpLimits().idle_timeout_s / 2


class Router:
    def __init__(self, cfg: RouterConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics()
        self.started = time.monotonic()
        self._stop = asyncio.Event()  # the health loop's stop signal
        self.forced = False  # a second signal stopped the process without draining
        self.listener: Listener | None = None
        self.admission = Admission(cfg.max_queue)
        self._monitor_task: asyncio.Task[None] | None = None
        # Set by startup(), inside the running loop.
        self.fleet: Fleet
        self.registry: Registry
        self.clients: dict[str, WorkerClient]
        self.backend: RemoteBackend
        self.monitor: HealthMonitor
        self.api: OpenAIApi

    async def startup(self, session: aiohttp.ClientSession) -> None:
        cfg = self.cfg
        self.clients = {
            u: WorkerClient(session, u, cfg.connect_timeout_s)
            for u in cfg.decode_urls + cfg.prefill_urls
        }
        log.info(
            "waiting at most %.0fs for %d workers to answer GET /info",
            cfg.startup_timeout_s,
            len(self.clients),
        )
        self.fleet = fleet = await discover(cfg, self.clients)
        prefix = PrefixSettings(  # the cache lives on P in PD, on the co-located workers else
            page_size=fleet_page_size(info for _, info in fleet.prefill or fleet.decode),
            index_pages=cfg.prefix_index_pages,
            max_imbalance=cfg.prefix_max_imbalance,
        )
        policy = make_policy(cfg.policy, prefix)
        self.registry = Registry.build(fleet.decode, fleet.prefill, policy)
        self.backend = RemoteBackend(
            cfg, self.registry, self.clients, self.metrics, fleet.vocab_size, fleet.max_model_len
        )
        canary = self.tokenizer.encode(CANARY_TEXT)
        validate_prompt(canary, CANARY_PARAMS, fleet.vocab_size, fleet.max_model_len)
        self.monitor = HealthMonitor(
            cfg,
            self.registry,
            self.clients,
            self.metrics,
            canary,
            self.backend.run_once,
            self.admission,  # a canary takes --max-queue slots like any generation
        )
        self.api = OpenAIApi(
            self.backend,
            self.tokenizer,
            cfg.served_model_name or fleet.model,
            fleet.max_model_len,
            cfg.request_timeout_s,
            prompt_char_bound(self.tokenizer.max_token_chars, fleet.max_model_len),
            cfg.frontend,
        )
        self._monitor_task = asyncio.get_running_loop().create_task(self.monitor.run(self._stop))

    # -- endpoints ----------------------------------------------------------------------
    def problems(self) -> list[str]:
        task = self._monitor_task
        if task is None or task.done():
            return ["the health loop is not running"]
        stale = self.monitor.stale_for()
        if stale > self.monitor.max_round_s:
            return [f"the health loop has not ticked for {stale:.1f}s"]
        return []

    async def health(self, request: web.Request) -> web.Response:
        problems = self.problems()
        rotation = [w.url for w in self.registry.workers if self.registry.in_rotation(w)]
        return web.json_response(
            {
                "status": "ok" if not problems else "unhealthy",
                "problems": problems,
                "workers": len(self.registry.workers),
                "in_rotation": rotation,
            },
            status=200 if not problems else 503,
        )

    async def health_deep(self, request: web.Request) -> web.Response:
        """The last canary round (at most DEEP_FRESH_S old, else a new one shared by every
        caller meanwhile) with its age; 429 when there never was one and --max-queue has no
        slots for it (router/health.py)."""
        answer = await self.monitor.answer()
        if answer.pairs is None:
            headers = {"Retry-After": str(RETRY_AFTER_S)}
            return web.json_response(answer.body(), status=429, headers=headers)
        return web.json_response(answer.body(), status=200 if answer.ok else 503)

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(self.registry),
            headers={"Content-Type": "text/plain; version=0.0.4"},
        )

    async def debug_cluster(self, request: web.Request) -> web.Response:
        async def state(url: str) -> dict[str, Any]:
            try:
                return {
                    "state": await self.clients[url].get_json(
                        "/debug/state", self.cfg.debug_timeout_s
                    )
                }
            except WorkerError as e:
                return {"error": str(e)}

        urls = [w.url for w in self.registry.workers]
        states = await asyncio.gather(*(state(u) for u in urls))
        return web.json_response(
            {
                "router": {
                    "pid": os.getpid(),
                    "uptime_s": round(time.monotonic() - self.started, 3),
                    "model": self.api.model_name,
                    "max_model_len": self.fleet.max_model_len,
                    "vocab_size": self.fleet.vocab_size,
                    "live_requests": self.backend.live_count,
                    "output_channels": {
                        url: ch.snapshot() for url, ch in self.backend.channels.items()
                    },
                    "problems": self.problems(),
                    "health_loop_errors": self.monitor.loop_errors,
                    "http": self.listener.snapshot() if self.listener is not None else None,
                    **self.registry.snapshot(),
                },
                "workers": {
                    w.url: {"role": w.role.value, **s}
                    for w, s in zip(self.registry.workers, states, strict=True)
                },
            }
        )

    def app(self, listener: Listener | None = None) -> web.Application:
        gate = Gate(
            self.cfg.api_key,
            ClusterKey.from_env(self.cfg.cluster_key_file),
            self.cfg.protect_health,
        )
        middlewares = [error_middleware(), gate.middleware(), self.admission.middleware()]
        if listener is not None:  # outermost: a connection is busy for all of a request
            middlewares.insert(0, listener.middleware())
        app = web.Application(middlewares=middlewares, **body_app_args(self.api.max_body_bytes))
        app.add_routes(self.api.routes())
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/health/deep", self.health_deep),
                web.get("/ping", self.health),  # vLLM's (SageMaker's) liveness probe
                web.post("/ping", self.health),
                web.get("/metrics", self.metrics_text),
                web.get("/debug/cluster", self.debug_cluster),
            ]
        )
        return app

    # -- lifecycle ----------------------------------------------------------------------
    async def serve(self, listener: Listener) -> int:
        """Serve on `listener`'s bound sockets until stopped; the exit status."""
        stop = Stop()
        stop.install(asyncio.get_running_loop())
        self.listener = listener
        # No connection cap: a cap would silently queue streams behind each other; the
        # workers bound admission themselves and every call carries its own timeout.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=WORKER_KEEPALIVE_S)
        key = ClusterKey.from_env(self.cfg.cluster_key_file)
        headers = key.http_headers if key is not None else None
        async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
            startup = asyncio.ensure_future(self.startup(session))
            await asyncio.wait(
                {startup, asyncio.ensure_future(stop.requested.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not startup.done():  # stopped while the fleet was still being discovered
                startup.cancel()
                log.info("stopped (%s) before the fleet was ready", stop.reason)
                return stop.exit_code or 0
            startup.result()  # raises what startup raised
            runner = await listener.serve(self.app(listener))
            freeze_startup_heap()  # no full GC pass over the tokenizer and libraries later
            announce_ready(f"http://{self.cfg.host}:{listener.port}")
            log.info(
                "routing %s over %d decode and %d prefill workers (%s) on http://%s:%d",
                self.api.model_name,
                len(self.registry.decode),
                len(self.registry.prefill),
                self.cfg.policy,
                self.cfg.host,
                listener.port,
            )
            await stop.requested.wait()
            listener.stop_accepting()
            self.admission.draining = True
            drain_s = self.cfg.drain_timeout_s
            log.info(
                "shutting down (%s): %d requests live, waiting at most %.0fs for them; "
                "signal again to stop at once",
                stop.reason,
                self.backend.live_count,
                drain_s,
            )
            drained = await stop.drain(lambda: self.backend.live_count == 0, drain_s)
            if not drained and not stop.forced.is_set():
                log.warning(
                    "%d requests still live after %.0fs; aborting them",
                    self.backend.live_count,
                    drain_s,
                )
            if stop.forced.is_set():
                self.forced = True
                log.warning("stopped at once: %d requests dropped", self.backend.live_count)
                return stop.exit_code or 1
            # The health loop first: a canary must not open a channel that close() closed.
            code = await stop.unless_forced(self._stop_monitor(), ROUTER_STOP_S + 1.0)
            closing = self.backend.close("the router is shutting down")
            await stop.unless_forced(closing, self.cfg.abort_timeout_s + 2.0)
            await stop.unless_forced(runner.cleanup(), HANDLERS_STOP_S + ROUTER_STOP_S)
            self.api.close()
        if stop.forced.is_set():
            self.forced = True
            return stop.exit_code or 1
        return 1 if code is None else code

    async def _stop_monitor(self) -> int:
        task = self._monitor_task
        if task is None:
            return 0
        self._stop.set()  # the health loop's stop signal too; it may have ended already
        if task.done():
            if task.cancelled() or task.exception() is not None:
                why = "cancelled" if task.cancelled() else repr(task.exception())
                log.error("the health loop had died before shutdown: %s", why)
                return 1
            return 0
        done, _ = await asyncio.wait({task}, timeout=ROUTER_STOP_S)
        if not done:
            task.cancel()
            log.error("the health loop did not stop within %.0fs; cancelled", ROUTER_STOP_S)
        return 0


def run_router(cfg: RouterConfig) -> int:
    """Bind, load the tokenizer, serve: the exit status (2: the port cannot be had)."""
    try:
        sockets = bind(cfg.host, cfg.port, reuse_port=cfg.reuse_port)
    except OSError as e:
        log.error("%s", bind_error(cfg.host, cfg.port, e))
        return 2
    try:
        router = Router(cfg, Tokenizer.from_dir(Path(cfg.model_path)))
        # Two descriptors a request: the client's connection and one to a worker.
        listener = Listener(sockets, cfg.http, fds_per_connection=2)
    except BaseException:
        _close(sockets)
        raise
    code = evloop.run(router.serve(listener))
    sys.stdout.flush()
    if router.forced:  # stop now: leave sockets and tasks to the end of the process
        logging.shutdown()
        sys.stderr.flush()
        os._exit(code)
    return code


def _close(sockets: list[socket.socket]) -> None:
    for s in sockets:
        s.close()
