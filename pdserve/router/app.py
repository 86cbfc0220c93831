"""The router process: OpenAI API over a fleet of workers, plus health, metrics, debug.

Lifecycle: startup (discover the fleet, refuse a fleet that cannot work; start the health
loop; bind) -> serve -> drain (stop accepting; running requests may finish up to a bound)
-> stop (abort the rest on their workers, stop the health loop, close the client session).
One aiohttp ClientSession carries every call to every worker; each call has its own timeout.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling import validate_prompt
from pdserve.router.backend import RemoteBackend
from pdserve.router.client import WorkerClient, WorkerError
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import Fleet, discover
from pdserve.router.health import CANARY_PARAMS, HealthMonitor
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import make_policy
from pdserve.router.registry import Registry
from pdserve.runtime.cluster_key import ClusterKey
from pdserve.runtime.ready import announce_ready
from pdserve.server.admission import Admission
from pdserve.server.auth import Gate
from pdserve.server.errors import error_middleware
from pdserve.server.openai_api import OpenAIApi

log = logging.getLogger(__name__)

CANARY_TEXT = "The health check says:"
STOP_S = 5.0  # bound on stopping the health loop and on aiohttp's own shutdown


class Router:
    def __init__(self, cfg: RouterConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics()
        self.started = time.monotonic()
        self._stop = asyncio.Event()
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
        self.fleet = fleet = await discover(cfg, self.clients)
        self.registry = Registry.build(fleet.decode, fleet.prefill, make_policy(cfg.policy))
        self.backend = RemoteBackend(
            cfg, self.registry, self.clients, self.metrics, fleet.vocab_size, fleet.max_model_len
        )
        canary = self.tokenizer.encode(CANARY_TEXT)
        validate_prompt(canary, CANARY_PARAMS, fleet.vocab_size, fleet.max_model_len)
        self.monitor = HealthMonitor(cfg, self.registry, self.clients, self.metrics, canary)
        self.api = OpenAIApi(
            self.backend,
            self.tokenizer,
            cfg.served_model_name or fleet.model,
            fleet.max_model_len,
            cfg.request_timeout_s,
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
        results = await self.monitor.deep()
        ok = all(r["ok"] for r in results)
        return web.json_response({"ok": ok, "pairs": results}, status=200 if ok else 503)

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
                    "problems": self.problems(),
                    "health_loop_errors": self.monitor.loop_errors,
                    **self.registry.snapshot(),
                },
                "workers": {
                    w.url: {"role": w.role.value, **s}
                    for w, s in zip(self.registry.workers, states, strict=True)
                },
            }
        )

    def app(self) -> web.Application:
        gate = Gate(
            self.cfg.api_key,
            ClusterKey.from_env(self.cfg.cluster_key_file),
            self.cfg.protect_health,
        )
        app = web.Application(
            client_max_size=64 * 2**20,
            middlewares=[
                error_middleware(),
                gate.middleware(),
                Admission(self.cfg.max_queue).middleware(),
            ],
        )
        app.add_routes(self.api.routes())
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/health/deep", self.health_deep),
                web.get("/metrics", self.metrics_text),
                web.get("/debug/cluster", self.debug_cluster),
            ]
        )
        return app

    # -- lifecycle ----------------------------------------------------------------------
    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        # No connection cap: a cap would silently queue streams behind each other; the
        # workers bound admission themselves and every call carries its own timeout.
        connector = aiohttp.TCPConnector(limit=0)
        key = ClusterKey.from_env(self.cfg.cluster_key_file)
        headers = key.http_headers if key is not None else None
        async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
            await self.startup(session)
            runner = web.AppRunner(
                self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=STOP_S
            )
            await runner.setup()
            site = web.TCPSite(runner, self.cfg.host, self.cfg.port, backlog=1024)
            await site.start()
            port = runner.addresses[0][1]
            announce_ready(f"http://{self.cfg.host}:{port}")
            log.info(
                "routing %s over %d decode and %d prefill workers (%s) on http://%s:%d",
                self.api.model_name,
                len(self.registry.decode),
                len(self.registry.prefill),
                self.cfg.policy,
                self.cfg.host,
                port,
            )
            await self._stop.wait()
            log.info("shutting down: draining %d live requests", self.backend.live_count)
            await site.stop()
            if not await self.backend.wait_idle(self.cfg.drain_timeout_s):
                log.warning(
                    "%d requests still live after %.0fs; aborting them",
                    self.backend.live_count,
                    self.cfg.drain_timeout_s,
                )
            await self.backend.close("the router is shutting down")
            code = await self._stop_monitor()
            await runner.cleanup()
        return code

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
        done, _ = await asyncio.wait({task}, timeout=STOP_S)
        if not done:
            task.cancel()
            log.error("the health loop did not stop within %.0fs; cancelled", STOP_S)
        return 0


def run_router(cfg: RouterConfig) -> int:
    tokenizer = Tokenizer.from_dir(Path(cfg.model_path))
    code = asyncio.run(Router(cfg, tokenizer).serve())
    sys.stdout.flush()
    return code
