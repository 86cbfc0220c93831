"""RemoteBackend: the server's Backend protocol (validate/submit/abort) over workers' HTTP.

`submit` starts one asyncio task per request. The task picks a route (D, and P when there
is a prefill pool), POSTs D's /generate and feeds each NDJSON line to the sink.

Invariants:
* the sink hears exactly one finish: the worker's own, or one error output that names the
  worker and what happened; an aborted task says nothing more (nobody is listening);
* a route's outstanding count is released exactly once, when its attempt ends;
* a request is re-routed only when the connection to D was refused, i.e. D never saw it;
* `abort` cancels the task (closing the connection, which D takes as an abort) and also
  POSTs D's /abort, fire-and-forget with a short timeout, so D hears it even if the
  connection close is lost in a proxy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams, validate_prompt
from pdserve.router.client import WorkerClient, WorkerError
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import NoRoute, Registry, Route
from pdserve.runtime.timing import REMOTE_GRACE_S

log = logging.getLogger(__name__)


Sink = Callable[[RequestOutput], None]


def generate_body(
    request_id: str, prompt_ids: list[int], params: SamplingParams, timeout_s: float, route: Route
) -> dict[str, Any]:
    """D's /generate body; "prefill" names P's control address, absent for a co-located D."""
    body: dict[str, Any] = {
        "request_id": request_id,
        "prompt_ids": list(prompt_ids),
        "params": params.to_builtins(),
        "timeout_s": timeout_s,
    }
    if route.prefill is not None:
        body["prefill"] = route.prefill.control
    return body


def error_output(request_id: str, message: str) -> RequestOutput:
    return RequestOutput(request_id, (), (), "error", message)


@dataclass
class _Live:
    sink: Sink
    task: asyncio.Task[None] | None = None
    route: Route | None = None  # the attempt in flight; None between attempts


class RemoteBackend:
    def __init__(
        self,
        cfg: RouterConfig,
        registry: Registry,
        clients: dict[str, WorkerClient],
        metrics: RouterMetrics,
        vocab_size: int,
        max_model_len: int,
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        self.clients = clients
        self.metrics = metrics
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._live: dict[str, _Live] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._background: set[asyncio.Task[None]] = set()

    @property
    def live_count(self) -> int:
        return len(self._live)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Engine.validate's checks (the same function) against the fleet's limits: the
        router refuses exactly what a worker would, with the same message."""
        validate_prompt(prompt_ids, params, self.vocab_size, self.max_model_len)

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        timeout_s: float | None = None,
    ) -> None:
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already live in the router")
        live = _Live(sink)
        timeout = timeout_s or self.cfg.request_timeout_s
        live.task = asyncio.get_running_loop().create_task(
            self._run(request_id, list(prompt_ids), params, timeout, live), name=request_id
        )
        self._live[request_id] = live
        self._idle.clear()

    def abort(self, request_id: str) -> None:
        live = self._forget(request_id)
        if live is None:
            return  # finished already, or never ours
        if live.task is not None:
            live.task.cancel()
        if live.route is not None:
            self.spawn(self._send_abort(live.route, request_id))

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is live; False if some still are after timeout_s."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def close(self, why: str) -> None:
        """Abort every live request on its worker and fail it towards the client."""
        for rid in list(self._live):
            live = self._live[rid]
            self.abort(rid)
            live.sink(error_output(rid, why))
        if self._background:
            await asyncio.wait(self._background, timeout=self.cfg.abort_timeout_s + 1.0)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """A fire-and-forget task, kept referenced until it ends (asyncio holds weak refs)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- the request task ---------------------------------------------------------------
    def _forget(self, request_id: str) -> _Live | None:
        live = self._live.pop(request_id, None)
        if not self._live:
            self._idle.set()
        return live

    async def _run(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        timeout_s: float,
        live: _Live,
    ) -> None:
        outcome = "error"
        t0 = time.monotonic()
        tried: list[str] = []
        try:
            while True:
                try:
                    route = self.registry.choose(exclude=tried, prompt=prompt_ids)
                except NoRoute as e:
                    outcome = "rejected"
                    live.sink(error_output(rid, str(e)))
                    return
                outcome, refused = await self._attempt(
                    rid, prompt_ids, params, timeout_s, live, route, t0
                )
                if refused is None:
                    return
                # D never saw the request, so it may go elsewhere, if anyone is left.
                tried.append(route.decode.url)
                if not any(
                    self.registry.in_rotation(d) and d.url not in tried
                    for d in self.registry.decode
                ):
                    live.sink(error_output(rid, f"{route.describe()} failed: {refused.what}"))
                    return
                self.metrics.connect_retries.inc()
        except asyncio.CancelledError:
            outcome = "aborted"
            raise
        finally:
            self.metrics.requests.labels(outcome).inc()
            self._forget(rid)

    async def _attempt(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        timeout_s: float,
        live: _Live,
        route: Route,
        t0: float,
    ) -> tuple[str, WorkerError | None]:
        """One try on one route: (outcome, the error if D refused the connection).

        Every other failure is final and reported to the sink here; a refused connection is
        left to the caller, which may re-route.
        """
        self.registry.acquire(route)
        live.route = route
        client = self.clients[route.decode.url]
        body = generate_body(rid, prompt_ids, params, timeout_s, route)
        first = True
        try:
            async for out in client.generate(body, timeout_s + REMOTE_GRACE_S):
                if first and (out.token_ids or out.finish_reason):
                    self.metrics.ttft.observe(time.monotonic() - t0)
                    first = False
                live.sink(out)
                if out.finish_reason is not None:
                    return ("ok" if out.finish_reason in ("stop", "length") else "error"), None
            raise WorkerError(route.decode.url, "the stream ended early")  # generate() prevents it
        except WorkerError as e:
            if e.connect:
                # Take D out now rather than at the next health poll.
                note = self.registry.mark_worker(route.decode.url, False, e.what, time.monotonic())
                if note:
                    log.warning("%s", note)
                return "error", e
            live.sink(error_output(rid, f"{route.describe()} failed: {e.what}"))
            return "error", None
        finally:
            live.route = None
            self.registry.release(route)

    async def _send_abort(self, route: Route, rid: str) -> None:
        try:
            await self.clients[route.decode.url].abort(rid, self.cfg.abort_timeout_s)
        except WorkerError as e:
            # The closed connection already aborts it on D; this is the belt to those braces.
            log.warning("abort of %s not confirmed by %s: %s", rid, route.describe(), e.what)
