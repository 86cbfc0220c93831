"""RemoteBackend: the server's Backend protocol (validate/submit/abort) over workers' HTTP.

`submit` starts one asyncio task per request. The task picks a route (D, and P when there
is a prefill pool) and POSTs D's /generate. With `--worker-streams shared` (the default) the
request names D's output channel (router/channel.py: one stream per worker carries every
request's outputs, so each engine burst is one write on D and one read here), /generate
answers once D's engine has it, and the task waits for its finish while the channel feeds the
sink. With `per-request`, /generate streams the request's own NDJSON lines to the sink.

Invariants:
* the sink hears exactly one finish: the worker's own, or one error output that names the
  worker and what happened; an aborted task says nothing more (nobody is listening);
* a route's outstanding count is released exactly once, when its attempt ends;
* a request is re-routed only when D never saw it: the connection was refused, or D answered
  503 (stopping, full; a channel D no longer knows is replaced once first);
* `abort` cancels the task and POSTs D's /abort, fire-and-forget with a short timeout; the
  aborts of one loop turn leave as one POST per worker (a client that dies with 60 streams
  open costs each worker one call, not 60). On its own stream, closing the connection aborts
  the request on D too; a request that D may still run after its attempt failed or ran past
  its deadline on a channel is aborted on D the same way, since the channel stays open, and
  again if its outputs keep coming (router/channel.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import msgspec

from pdserve.protocol.generate import Generate
from pdserve.protocol.outputs import MAX_ABORT_IDS, RequestOutput
from pdserve.protocol.sampling import SamplingParams, validate_prompt
from pdserve.router.channel import Receiver, WorkerChannel
from pdserve.router.client import WorkerClient, WorkerError
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import NoRoute, Registry, Route
from pdserve.runtime.timing import REMOTE_GRACE_S

log = logging.getLogger(__name__)


Sink = Callable[[RequestOutput], None]


def generate_body(
    request_id: str, prompt_ids: list[int], params: SamplingParams, timeout_s: float, route: Route
) -> Generate:
    """D's /generate body; `prefill` names P's control address (router/discovery.py checked
    it at startup), absent for a co-located D."""
    prefill = msgspec.UNSET if route.prefill is None else str(route.prefill.control)
    return Generate(request_id, prompt_ids, params, timeout_s, prefill)


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
        self._aborts: dict[str, list[str]] = {}  # D's url -> ids for this loop turn's POST
        self.closed = False  # close() has run
        self.channels: dict[str, WorkerChannel] = {}  # D's url -> its output channel
        if cfg.worker_streams == "shared":
            self.channels = {
                d.url: WorkerChannel(
                    clients[d.url],
                    cfg.connect_timeout_s,
                    functools.partial(self._send_abort, d.url),
                )
                for d in registry.decode
            }

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
            self._send_abort(live.route.decode.url, request_id)

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is live; False if some still are after timeout_s."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def close(self, why: str) -> None:
        """Abort every live request on its worker and fail it towards the client; close the
        output channels."""
        self.closed = True
        for rid in list(self._live):
            live = self._live[rid]
            self.abort(rid)
            live.sink(error_output(rid, why))
        for url in list(self._aborts):  # now, not at the end of this loop turn
            self._flush_aborts(url)
        if self._background:
            await asyncio.wait(self._background, timeout=self.cfg.abort_timeout_s + 1.0)
        for ch in self.channels.values():
            await ch.close()

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
                if not tried:  # a request counts once, by the route it was first given
                    mode = self.registry.count_routed(route, time.monotonic())
                    self.metrics.routed.labels(mode.value).inc()
                outcome, refused = await self._attempt(
                    rid, prompt_ids, params, timeout_s, live, route, t0
                )
                if refused is None:
                    if outcome == "ok":  # the pair serves (the health canary reads it)
                        self.registry.served(route.key, time.monotonic())
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
        url = route.decode.url
        body = generate_body(rid, prompt_ids, params, timeout_s, route)
        try:
            channel = self.channels.get(url)
            wait_s = timeout_s + REMOTE_GRACE_S
            if channel is not None:
                return await self._on_channel(channel, body, wait_s, live, route, t0), None
            return await self._on_own_stream(body, wait_s, live, route, t0), None
        except WorkerError as e:
            if e.connect:
                if e.mark_down:  # take D out now rather than at the next health poll
                    note = self.registry.mark_worker(url, False, e.what, time.monotonic())
                    if note:
                        log.warning("%s", note)
                return "error", e
            live.sink(error_output(rid, f"{route.describe()} failed: {e.what}"))
            return "error", None
        finally:
            live.route = None
            self.registry.release(route)

    async def run_once(self, route: Route, body: Generate, wait_s: float) -> list[RequestOutput]:
        """One request on `route` the way the clients' go (on D's channel, or its own stream),
        outside their bookkeeping (no outstanding count, no metrics): every output, the last
        with its finish; WorkerError if it failed or took longer than `wait_s`. The health
        canary's, so that it exercises the path real requests take."""
        if self.closed:
            raise WorkerError(route.decode.url, "the router is shutting down")
        outs: list[RequestOutput] = []
        live = _Live(outs.append)
        channel = self.channels.get(route.decode.url)
        if channel is not None:
            await self._on_channel(channel, body, wait_s, live, route, None)
        else:
            await self._on_own_stream(body, wait_s, live, route, None)
        return outs

    def _receiver(
        self, live: _Live, url: str, t0: float | None, done: asyncio.Future[str]
    ) -> Receiver:
        """Feeds the sink (and, from `t0`, the TTFT histogram); `done` gets the outcome at the
        finish, or the WorkerError."""
        first = t0 is not None

        def output(out: RequestOutput) -> None:
            nonlocal first
            if first and t0 is not None and (out.token_ids or out.finish_reason):
                self.metrics.ttft.observe(time.monotonic() - t0)
                first = False
            live.sink(out)
            if out.finish_reason is not None and not done.done():
                done.set_result("ok" if out.finish_reason in ("stop", "length") else "error")

        def broken(what: str) -> None:
            if not done.done():
                done.set_exception(WorkerError(url, what))

        return Receiver(output, broken)

    async def _on_channel(
        self,
        channel: WorkerChannel,
        body: Generate,
        wait_s: float,
        live: _Live,
        route: Route,
        t0: float | None,
    ) -> str:
        """The request on D's output channel: its outcome once the finish came (the sink has
        had every output) within `wait_s`; WorkerError otherwise, as `_attempt` reads it."""
        rid, url = body.request_id, route.decode.url
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        done: asyncio.Future[str] = loop.create_future()
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        receiver = self._receiver(live, url, t0, done)
        try:
            # Twice at most: the stream may end between its opening and the request's
            # registration, or D may no longer know it (a stale, half-open stream).
            for _ in range(2):
                try:
                    if await self._send_on(channel, body, receiver, done, deadline):
                        break
                except TimeoutError:  # the opening (the client bounds it too)
                    why = f"no output stream within {wait_s:.1f}s"
                    raise WorkerError(url, why, True, mark_down=False) from None
            else:
                raise WorkerError(
                    url, "its output stream closed as the request was sent", True, mark_down=False
                )
            try:
                async with asyncio.timeout_at(deadline):
                    return await asyncio.shield(done)
            except TimeoutError:
                self._send_abort(url, rid)
                raise WorkerError(url, f"the request did not finish within {wait_s:.1f}s") from None
        finally:
            channel.unregister(rid)  # if it has not finished, its later outputs are orphans

    async def _send_on(
        self,
        channel: WorkerChannel,
        body: Generate,
        receiver: Receiver,
        done: asyncio.Future[str],
        deadline: float,
    ) -> bool:
        """Register the request on the channel and POST its /generate, by `deadline` (the
        loop's clock): True once D has it (or its finish, in `done`, overtook an answer that
        then failed), False to try again (the channel ended or D no longer knows it),
        TimeoutError if the channel did not open by then, WorkerError for anything else
        (`_attempt` reads it)."""
        rid, url = body.request_id, channel.client.url
        loop = asyncio.get_running_loop()
        async with asyncio.timeout_at(deadline):
            cid = await channel.ready()
        if not channel.register(cid, rid, receiver):
            return False
        try:
            on_channel = msgspec.structs.replace(body, channel=cid)
            await self.clients[url].submit(on_channel, max(deadline - loop.time(), 0.001))
            return True
        except WorkerError as e:
            if done.done() and not done.cancelled() and done.exception() is None:
                return True  # it finished before /generate's answer failed: that is the outcome
            if e.code == "channel_closed":
                channel.discard(rid)
                channel.reset(cid)
                return False
            if e.connect or (e.status is not None and e.status < 500):
                channel.discard(rid)  # D never took it
            else:  # D may have it: a timeout, a broken answer, a 500
                self._send_abort(url, rid)
            raise

    async def _on_own_stream(
        self, body: Generate, wait_s: float, live: _Live, route: Route, t0: float | None
    ) -> str:
        """The request on a /generate stream of its own; its outcome, as `_on_channel`."""
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        receiver = self._receiver(live, route.decode.url, t0, done)
        async for out in self.clients[route.decode.url].generate(body, wait_s):
            receiver.output(out)
            if done.done():
                return done.result()
        raise WorkerError(route.decode.url, "the stream ended early")  # generate() prevents it

    def _send_abort(self, url: str, rid: str) -> None:
        """Abort `rid` on D: it joins the POST that leaves at the end of this loop turn."""
        batch = self._aborts.get(url)
        if batch is None:
            batch = self._aborts[url] = []
            asyncio.get_running_loop().call_soon(self._flush_aborts, url)
        batch.append(rid)

    def _flush_aborts(self, url: str) -> None:
        ids = self._aborts.pop(url, [])
        for i in range(0, len(ids), MAX_ABORT_IDS):
            self.spawn(self._post_aborts(url, ids[i : i + MAX_ABORT_IDS]))

    async def _post_aborts(self, url: str, ids: list[str]) -> None:
        try:
            await self.clients[url].abort(ids, self.cfg.abort_timeout_s)
        except WorkerError as e:
            # On its own stream, the closed connection already aborts it on D; on a channel,
            # its outputs still coming will abort it again (router/channel.py).
            shown = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
            log.warning("abort of %s not confirmed by %s: %s", shown, url, e.what)
