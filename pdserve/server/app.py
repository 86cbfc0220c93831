"""The co-located server process: engine thread + supervisor + aiohttp API.

Lifecycle: startup (load, warm up, bind) -> serve -> drain (stop accepting, let requests
finish up to a bound) -> stop (abort the rest, stop threads with a timeout). A supervised
thread that dies for good triggers the same shutdown with a non-zero exit code.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

from pdserve.config import ServerConfig
from pdserve.engine.engine import Engine
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.messages import Msg, Send
from pdserve.runtime.cluster_key import ClusterKey
from pdserve.runtime.faults import FAULTS
from pdserve.runtime.ready import announce_ready
from pdserve.runtime.supervisor import Supervisor
from pdserve.runtime.timing import ENGINE_HEARTBEAT_S
from pdserve.server.admission import Admission
from pdserve.server.auth import Gate
from pdserve.server.errors import error_middleware
from pdserve.server.openai_api import OpenAIApi, error_response, read_json
from pdserve.server.openai_protocol import ApiError
from pdserve.transfer.control import Control, Inbound
from pdserve.transfer.copier import Copier
from pdserve.transfer.receiver import needs_shared_pool
from pdserve.worker.api import WorkerApi
from pdserve.worker.decode import DecodeRole
from pdserve.worker.prefill import PrefillRole
from pdserve.worker.roles import SendFailed

log = logging.getLogger(__name__)


class Server:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.fatal: str | None = None
        self._stop_event: asyncio.Event | None = None
        self.supervisor = Supervisor(on_fatal=self._on_fatal)
        # First, before any model is loaded: a worker without its key cannot serve.
        self.key = ClusterKey.from_env(cfg.cluster_key_file)
        if self.key is None and cfg.role != "colocated":
            raise ValueError(
                f"a {cfg.role} worker needs the cluster key: --cluster-key-file FILE or "
                "$PDSERVE_CLUSTER_KEY_FILE (`pdserve keygen --out FILE` makes one; "
                "`pdserve launch` makes one per cluster)"
            )
        self.tokenizer = Tokenizer.from_dir(Path(cfg.engine.model.path))
        eos = self.tokenizer.eos_token_ids
        self.control: Control | None = None
        self.copier: Copier | None = None
        info: dict[str, Any] = {"pid": os.getpid()}
        self.engine: Engine
        if cfg.role == "colocated":
            self.engine = Engine.build(cfg.engine, eos)
        else:
            identity = f"{cfg.role}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            assert self.key is not None  # checked above for every role but colocated
            self.control = Control(identity, self._to_engine, self._send_failed, self.key)
            if cfg.role == "prefill":
                self.engine = Engine.build(cfg.engine, eos)
                info["control"] = self.control.bind(cfg.host, cfg.control_port)
                self.copier = Copier()
                role = PrefillRole(self.engine, identity, self.control, self.copier)
                self.engine.attach(role, self._send)
            else:
                shared = needs_shared_pool(cfg.backend)
                self.engine = Engine.build(cfg.engine, eos, shared_pool=shared)
                d_role = DecodeRole(self.engine, identity, cfg.backend, self.control)
                self.engine.attach(d_role, self._send)
            info.update(identity=identity, backend=cfg.backend)
        self.api = OpenAIApi(
            self.engine,
            self.tokenizer,
            cfg.engine.model.name,
            self.engine.max_model_len,
            cfg.engine.request_timeout_s,
        )
        self.worker_api = WorkerApi(
            self.engine,
            cfg.role,
            cfg.engine.model.name,
            {"layout": self.engine.pool.layout.to_dict(), **info},
        )
        self.admission = Admission(cfg.max_queue)
        self.started = time.monotonic()

    def _to_engine(self, inbound: Inbound) -> None:
        self.engine.on_control(inbound)  # on this (control) thread: see Engine.on_control
        self.engine.inbox.put(inbound)

    def _send(self, out: Send) -> None:
        assert self.control is not None  # only a prefill or decode role sends
        self.control.send(out.peer, out.msg, out.frames)

    def _send_failed(self, peer: str, msg: Msg, why: str) -> None:
        self.engine.inbox.put(SendFailed(peer, msg, why))

    def _on_fatal(self, why: str) -> None:
        self.fatal = why
        loop, ev = getattr(self, "_loop", None), self._stop_event
        if loop is not None and ev is not None:
            loop.call_soon_threadsafe(ev.set)

    # -- endpoints ------------------------------------------------------------------------
    def problems(self) -> list[str]:
        out = self.supervisor.problems()
        stale = time.monotonic() - self.engine.last_tick
        if stale > ENGINE_HEARTBEAT_S:
            out.append(f"engine loop has not ticked for {stale:.1f}s")
        overdue = self.engine.overdue
        if overdue:
            more = f" (and {len(overdue) - 1} more)" if len(overdue) > 1 else ""
            out.append(f"past its deadline and not ended: {overdue[0]}{more}")
        return out

    async def health(self, request: web.Request) -> web.Response:
        problems = self.problems()
        return web.json_response(
            {"status": "ok" if not problems else "unhealthy", "problems": problems},
            status=200 if not problems else 503,
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.engine.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def debug_state(self, request: web.Request) -> web.Response:
        state: dict[str, Any] = {
            "role": self.cfg.role,
            "model": self.cfg.engine.model.name,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "threads": self.supervisor.snapshot(),
            "problems": self.problems(),
        }
        try:
            state["engine"] = await asyncio.to_thread(self.engine.snapshot, 2.0)
        except TimeoutError:
            state["engine"] = {"error": "the engine thread did not answer within 2 s"}
        return web.json_response(state)

    async def debug_invariants(self, request: web.Request) -> web.Response:
        """At quiescence: no live request, every page free, every thread alive and fresh. At any
        time: every page's reference count equals the number of live leases holding it."""
        try:
            eng = await asyncio.to_thread(self.engine.snapshot, 2.0)
        except TimeoutError:
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
        if pool["pages_free"] != pool["pages_total"]:
            violations.append(f"pages free {pool['pages_free']} != total {pool['pages_total']}")
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
        return web.json_response(FAULTS.snapshot())

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
            FAULTS.configure(spec, seed)
        except ValueError as e:
            return error_response(ApiError(400, str(e), param="spec", code="bad_fault_spec"))
        return web.json_response(FAULTS.snapshot())

    def app(self) -> web.Application:
        # The error middleware is the outer one: a 401 passes through it unchanged.
        gate = Gate(self.cfg.api_key, self.key, self.cfg.protect_health)
        app = web.Application(
            client_max_size=64 * 2**20,
            middlewares=[error_middleware(), gate.middleware(), self.admission.middleware()],
        )
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
    async def serve(self, drain_timeout_s: float = 10.0) -> int:
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.add_signal_handler(sig, self._stop_event.set)
        self.supervisor.spawn("engine", self.engine.tick, heartbeat_timeout_s=ENGINE_HEARTBEAT_S)
        if self.control is not None:
            self.supervisor.spawn("control", self.control.tick, heartbeat_timeout_s=5.0)
        if self.copier is not None:
            self.supervisor.spawn("dataplane", self.copier.tick, heartbeat_timeout_s=5.0)
        runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.cfg.host, self.cfg.port, backlog=1024)
        await site.start()
        port = runner.addresses[0][1]
        if self.fatal is None:  # never announce a process that is already dying
            announce_ready(f"http://{self.cfg.host}:{port}")
        log.info("serving %s on http://%s:%d", self.cfg.engine.model.name, self.cfg.host, port)
        await self._stop_event.wait()
        log.info("shutting down%s", f" (fatal: {self.fatal})" if self.fatal else "")
        # Drain: stop accepting, give running requests a bounded time to finish.
        await site.stop()
        deadline = time.monotonic() + drain_timeout_s
        while self.engine.scheduler.has_work() and time.monotonic() < deadline and not self.fatal:
            await asyncio.sleep(0.05)
        await runner.cleanup()
        stuck = self.supervisor.stop(timeout_s=5.0)
        if not stuck:  # the engine thread no longer touches the transfer agents
            self.engine.role.settle()
        if self.control is not None:
            self.control.close()
        self.engine.pool.close()
        if stuck:
            log.error("threads did not stop in time: %s", stuck)
        return 1 if self.fatal or stuck else 0


def run_server(cfg: ServerConfig) -> int:
    server = Server(cfg)
    code = 1
    try:
        code = asyncio.run(server.serve())
    except Exception:  # noqa: BLE001 - logged; the exit below must still happen
        log.exception("the server failed")
    sys.stdout.flush()
    if server.engine.role.hard_exit:
        # Do not let the interpreter destroy the NIXL agent: UCX aborts the process (an
        # assertion) when it tears down an endpoint that still has requests queued for a
        # peer that is stopped. The orderly shutdown is done; leave without that teardown.
        logging.shutdown()
        sys.stderr.flush()
        os._exit(code)
    return code
