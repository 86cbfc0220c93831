"""RemoteBackend and the worker client against fake workers in this process (no model), on
per-request /generate streams (`--worker-streams per-request`; the shared output channel is
tests/router/test_channels.py's).

Each fake misbehaves in one way; the router must turn every failure into exactly one error
output that names the worker, re-route only what a worker never saw, and abort promptly.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pdserve.protocol.outputs import RequestOutput, encode_line
from pdserve.protocol.sampling import SamplingParams
from pdserve.router import backend as backend_mod
from pdserve.router.backend import RemoteBackend
from pdserve.router.client import WorkerClient
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import RouterStartupError, check_fleet
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import make_policy
from pdserve.router.registry import Registry

PARAMS = SamplingParams(max_tokens=3, temperature=0)
Line = dict[str, Any]


def line(tokens: list[int], finish: str | None = None, rid: str = "r1") -> bytes:
    return encode_line(RequestOutput(rid, tuple(tokens), (), finish, None, 3))


class FakeWorker:
    """A worker API whose /generate runs `script(request, response)`."""

    def __init__(self, script: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> None:
        self.script = script
        self.bodies: list[Any] = []
        self.aborts: list[tuple[float, str]] = []
        self.cancelled = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        try:
            return await self.script(request)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def _abort(self, request: web.Request) -> web.Response:
        for rid in (await request.json())["request_ids"]:
            self.aborts.append((time.monotonic(), rid))
        return web.json_response({"ok": True})

    async def __aenter__(self) -> FakeWorker:
        app = web.Application()
        app.add_routes([web.post("/generate", self._generate), web.post("/abort", self._abort)])
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


async def stream(
    request: web.Request, *chunks: bytes, pause_s: float = 0.0, forever: bool = False
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    for c in chunks:
        await resp.write(c)
        await asyncio.sleep(pause_s)
    while forever:
        await resp.write(line([7]))
        await asyncio.sleep(0.02)
    await resp.write_eof()
    return resp


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def make_backend(
    session: aiohttp.ClientSession, decode: list[str], prefill: list[str] | None = None
) -> RemoteBackend:
    prefill = prefill or []
    cfg = RouterConfig(
        tuple(decode),
        tuple(prefill),
        model_path="unused",
        abort_timeout_s=1.0,
        worker_streams="per-request",
    )
    reg = Registry.build(
        [(u, {}) for u in decode],
        [(u, {"control": f"tcp://control-of-{i}"}) for i, u in enumerate(prefill)],
        make_policy("round-robin"),
    )
    clients = {u: WorkerClient(session, u, 1.0) for u in decode + prefill}
    return RemoteBackend(cfg, reg, clients, RouterMetrics(), vocab_size=100, max_model_len=64)


async def collect(backend: RemoteBackend, timeout_s: float = 5.0) -> list[RequestOutput]:
    q: asyncio.Queue[RequestOutput] = asyncio.Queue()
    backend.submit("r1", [1, 2, 3], PARAMS, q.put_nowait, timeout_s)
    outs = []
    while not outs or outs[-1].finish_reason is None:
        outs.append(await asyncio.wait_for(q.get(), 10))
    await asyncio.sleep(0.05)
    assert q.empty(), "exactly one finish, nothing after it"
    return outs


def requests(b: RemoteBackend, outcome: str) -> float | None:
    return b.metrics.registry.get_sample_value(
        "pdserve_router_requests_total", {"outcome": outcome}
    )


def run(coro: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await asyncio.wait_for(coro, 30)

    return asyncio.run(main())


def test_stream_passes_through_and_body_follows_the_contract():
    async def body() -> None:
        async def script(req: web.Request) -> web.StreamResponse:
            return await stream(req, line([5]), line([6, 7], "length"))

        async with FakeWorker(script) as w, aiohttp.ClientSession() as s:
            b = make_backend(s, [w.url])
            outs = await collect(b)
            assert [o.token_ids for o in outs] == [(5,), (6, 7)]
            assert outs[-1].finish_reason == "length" and outs[-1].num_prompt_tokens == 3
            sent = w.bodies[0]
            assert sent["request_id"] == "r1" and sent["prompt_ids"] == [1, 2, 3]
            assert sent["params"]["max_tokens"] == 3 and sent["timeout_s"] == 5.0
            assert "prefill" not in sent
            assert b.registry.decode[0].outstanding == 0 and b.live_count == 0
            assert requests(b, "ok") == 1

    run(body())


def test_pd_route_sends_the_prefill_workers_control_address():
    async def body() -> None:
        async def script(req: web.Request) -> web.StreamResponse:
            return await stream(req, line([1], "stop"))

        async with FakeWorker(script) as w, aiohttp.ClientSession() as s:
            b = make_backend(s, [w.url], prefill=["http://p0", "http://p1"])
            await collect(b)
            await collect(b)
            assert [x["prefill"] for x in w.bodies] == ["tcp://control-of-0", "tcp://control-of-1"]
            assert [p.outstanding for p in b.registry.prefill] == [0, 0]

    run(body())


@pytest.mark.parametrize(
    "chunks,expect",
    [
        ((line([5]),), "ended without a finish_reason"),
        ((b"this is not json\n",), "bad stream"),
        ((line([5])[:-2] + b"\n",), "bad stream"),
        (
            (
                json.dumps({"request_id": "r1", "token_ids": [1], "finish_reason": "done"}).encode()
                + b"\n",
            ),
            "unknown finish_reason 'done'",
        ),
        ((line([5], "stop", rid="r2"),), "an output of request 'r2' in the stream of 'r1'"),
    ],
)
def test_broken_streams_end_in_one_error_naming_the_worker(chunks, expect):
    async def body() -> None:
        async def script(req: web.Request) -> web.StreamResponse:
            return await stream(req, *chunks)

        async with FakeWorker(script) as w, aiohttp.ClientSession() as s:
            b = make_backend(s, [w.url])
            outs = await collect(b)
            last = outs[-1]
            assert last.finish_reason == "error" and last.error is not None
            assert expect in last.error and f"decode worker {w.url}" in last.error
            assert requests(b, "error") == 1
            assert b.registry.decode[0].outstanding == 0

    run(body())


def test_http_error_from_the_worker_is_an_error_with_its_message():
    async def body() -> None:
        async def script(req: web.Request) -> web.StreamResponse:
            err = {"error": {"message": "top_p must be in (0, 1]", "type": "x", "param": "top_p"}}
            return web.json_response(err, status=400)

        async with FakeWorker(script) as w, aiohttp.ClientSession() as s:
            last = (await collect(make_backend(s, [w.url])))[-1]
            assert last.finish_reason == "error"
            assert "HTTP 400: top_p must be in (0, 1]" in (last.error or "")

    run(body())


def test_refused_connection_reroutes_and_takes_the_worker_out():
    async def body() -> None:
        async def script(req: web.Request) -> web.StreamResponse:
            return await stream(req, line([9], "length"))

        dead = closed_port_url()
        async with FakeWorker(script) as w, aiohttp.ClientSession() as s:
            b = make_backend(s, [dead, w.url])  # round-robin tries the dead one first
            outs = await collect(b)
            assert outs[-1].finish_reason == "length" and len(w.bodies) == 1
            assert not b.registry.decode[0].healthy
            assert "cannot connect" in (b.registry.decode[0].last_error or "")
            assert b.metrics.registry.get_sample_value("pdserve_router_connect_retries_total") == 1
            # Only worker left is dead too: one error, naming it, no endless retry.
            b2 = make_backend(s, [dead])
            last = (await collect(b2))[-1]
            assert last.finish_reason == "error" and dead in (last.error or "")

    run(body())


def test_abort_cancels_the_stream_and_posts_abort_within_100ms():
    async def body() -> None:
        async def script(req: web.Request) -> web.StreamResponse:
            return await stream(req, forever=True)

        async with FakeWorker(script) as w, aiohttp.ClientSession() as s:
            b = make_backend(s, [w.url])
            q: asyncio.Queue[RequestOutput] = asyncio.Queue()
            b.submit("r1", [1, 2, 3], PARAMS, q.put_nowait, 30.0)
            await asyncio.wait_for(q.get(), 5)
            t0 = time.monotonic()
            b.abort("r1")
            await asyncio.wait_for(w.cancelled.wait(), 1.0)
            deadline = time.monotonic() + 1.0
            while not w.aborts and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            assert w.aborts and w.aborts[0][1] == "r1"
            assert w.aborts[0][0] - t0 < 0.1, f"abort took {w.aborts[0][0] - t0:.3f}s"
            await asyncio.sleep(0.1)
            while not q.empty():  # whatever was already in flight, but never a finish
                assert q.get_nowait().finish_reason is None
            assert b.live_count == 0 and b.registry.decode[0].outstanding == 0
            assert requests(b, "aborted") == 1
            b.abort("r1")  # twice, or after the end: harmless

    run(body())


def test_a_stalled_worker_times_out_with_an_error(monkeypatch):
    monkeypatch.setattr(backend_mod, "REMOTE_GRACE_S", 0.0)

    async def body() -> None:
        async def script(req: web.Request) -> web.StreamResponse:
            await asyncio.sleep(30)
            return web.Response()

        async with FakeWorker(script) as w, aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            last = (await collect(make_backend(s, [w.url]), timeout_s=0.3))[-1]
            assert time.monotonic() - t0 < 3.0
            assert last.finish_reason == "error" and "did not finish within" in (last.error or "")

    run(body())


def test_close_fails_live_requests_towards_the_client():
    async def body() -> None:
        async def script(req: web.Request) -> web.StreamResponse:
            return await stream(req, forever=True)

        async with FakeWorker(script) as w, aiohttp.ClientSession() as s:
            b = make_backend(s, [w.url])
            q: asyncio.Queue[RequestOutput] = asyncio.Queue()
            b.submit("r1", [1], PARAMS, q.put_nowait, 30.0)
            await asyncio.wait_for(q.get(), 5)
            assert not await b.wait_idle(0.05)
            await b.close("the router is shutting down")
            outs = [q.get_nowait() for _ in range(q.qsize())]
            assert outs[-1].finish_reason == "error" and "shutting down" in (outs[-1].error or "")
            assert await b.wait_idle(1.0) and [a[1] for a in w.aborts] == ["r1"]

    run(body())


def info(role: str, model: str = "m", max_len: int = 100, **kw: Any) -> dict[str, Any]:
    return {"role": role, "model": model, "max_model_len": max_len, "vocab_size": 50, **kw}


def test_check_fleet_takes_the_smallest_limits_and_refuses_bad_fleets():
    fleet = check_fleet(
        (("http://a", info("colocated")), ("http://b", info("colocated", max_len=80))), ()
    )
    assert (fleet.model, fleet.max_model_len, fleet.vocab_size) == ("m", 80, 50)
    # A prefill worker whose pool holds less than its decode worker's caps the fleet's context.
    pd = check_fleet(
        (("http://d", info("decode")),),
        (("http://p", info("prefill", max_len=60, control="tcp://127.0.0.1:5")),),
    )
    assert pd.max_model_len == 60
    bad = [
        (
            (("http://a", info("colocated")), ("http://b", info("colocated", model="n"))),
            (),
            "decode workers serve different models",
        ),
        ((("http://a", info("decode")),), (), "without --prefill workers the router needs role"),
        (
            (("http://a", info("colocated")),),
            (("http://p", info("prefill", control="tcp://x")),),
            "with --prefill workers",
        ),
        ((("http://a", info("decode")),), (("http://p", info("prefill")),), "no 'control'"),
        *(
            ((("http://a", info("decode")),), (("http://p", info("prefill", control=c)),), "got")
            for c in ("tcp://x", "tcp://p\ud800:1", "tcp://p:0", "udp://p:1", 5, "")
        ),
        (
            (("http://a", info("decode")),),
            (("http://p", info("prefill", model="n", control="tcp://x")),),
            "serves 'n'",
        ),
        ((("http://a", {"role": "colocated", "model": "m"}),), (), "no valid 'max_model_len'"),
    ]
    pd = check_fleet(
        (("http://a", info("decode")),), (("http://p", info("prefill", control="tcp://[::1]:9")),)
    )
    assert pd.prefill[0][1]["control"] == "tcp://[::1]:9"
    for decode, prefill, msg in bad:
        with pytest.raises(RouterStartupError, match=msg.replace("(", r"\(")):
            check_fleet(decode, prefill)
