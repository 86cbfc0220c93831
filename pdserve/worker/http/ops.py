"""A worker's operator endpoints: /health, /metrics and /debug/* (state, invariants, faults).

What they read: the supervisor's threads, the engine through its `EngineHost` surface (in this
process or in the engine process: worker/host/), the HTTP listener and the routers' output
channels. `pdserve doctor` reads /debug/state and /debug/invariants (doctor/diagnosis.py); keep
their keys stable. Fault points are set only on a server started with --debug-faults.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from pdserve.config import ServerConfig
from pdserve.frontend.api import error_response, read_json
from pdserve.frontend.protocol import ApiError
from pdserve.runtime.supervisor import Supervisor
from pdserve.server.listener import Listener
from pdserve.worker.host.local_engine import EngineHost
from pdserve.worker.http.channels import Channels


class OpsApi:
    def __init__(
        self,
        cfg: ServerConfig,
        supervisor: Supervisor,
        host: EngineHost,
        channels: Channels,
        uptime_s: Callable[[], float],
    ) -> None:
        self.cfg = cfg
        self.supervisor = supervisor
        self.host = host
        self.channels = channels
        self.uptime_s = uptime_s
        self.listener: Listener | None = None  # set once the server listens

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/health", self.health),
            *(web.route(m, "/ping", self.health) for m in ("GET", "POST")),  # vLLM's probe
            web.get("/metrics", self.metrics),
            web.get("/debug/state", self.debug_state),
            web.get("/debug/invariants", self.debug_invariants),
            web.get("/debug/faults", self.debug_faults),
            web.post("/debug/faults", self.set_faults),
        ]

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
            "uptime_s": round(self.uptime_s(), 3),
            "threads": self.supervisor.snapshot(),
            "problems": self.problems(),
            "http": self.listener.snapshot() if self.listener is not None else None,
            "output_channels": self.channels.snapshot(),
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
        if pool.get("state_slots_free", 0) != pool.get("state_slots", 0):
            violations.append(
                f"state slots free {pool['state_slots_free']} != total {pool['state_slots']}"
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
