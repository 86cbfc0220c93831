"""The shared output channel end to end in this process: the router's RemoteBackend
(`--worker-streams shared`) against the real worker API (worker/http/api.py,
worker/http/channels.py) over HTTP on 127.0.0.1, with a scripted engine thread instead of a model.

The rules under test (worker/http/channels.py): every request's tokens arrive in order with exactly
one finish; an abort reaches the engine and spares the others; the stream's end aborts what it
carried; a stopping worker ends an idle channel and the router sends new requests elsewhere;
a worker-side deadline ends in one error. (How the router copes with a worker that
misbehaves on a channel: tests/router/test_channel_faults.py.)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import aiohttp
import pytest

from pdserve.protocol.outputs import RequestOutput, decode_output, encode_line
from pdserve.router.health import HealthMonitor
from pdserve.worker.http import api as api_mod
from pdserve.worker.http.channels import TIMED_OUT, encode_burst
from tests.router.channel_fakes import (
    Collected,
    ScriptedEngine,
    backend,
    run,
    submit,
    until,
    worker,
)


def test_many_requests_share_one_stream_each_in_order_with_one_finish(monkeypatch):
    bursts: list[int] = []  # requests per write on the worker

    def counting(outs: Any) -> bytes:
        bursts.append(len({o.request_id for o in outs}))
        return encode_burst(outs)

    monkeypatch.setattr("pdserve.worker.http.channels.encode_burst", counting)

    async def body() -> None:
        async with worker(ScriptedEngine()) as (url, wapi), aiohttp.ClientSession() as s:
            b, c = backend(s, [url]), Collected()
            rids = [f"r{i}" for i in range(40)]
            for i, rid in enumerate(rids):
                submit(b, c, rid, 3 + i % 7)
            await c.wait(*rids)
            for i, rid in enumerate(rids):
                assert c.tokens(rid) == list(range(3 + i % 7)), rid
                assert c.finish(rid).finish_reason == "length"
            assert b.channels[url].opened == 1 and len(wapi.channels) == 1
            assert b.metrics.registry.get_sample_value(
                "pdserve_router_requests_total", {"outcome": "ok"}
            ) == len(rids)
            await until(lambda: b.live_count == 0 and len(b.channels[url]) == 0)
            await b.close("test over")

    run(body())
    assert max(bursts) > 1, "every write carried one request: nothing shared the stream"


def test_abort_reaches_the_engine_and_spares_the_other_requests():
    async def body() -> None:
        engine = ScriptedEngine(tick_s=0.005)
        async with worker(engine) as (url, _), aiohttp.ClientSession() as s:
            b, c = backend(s, [url]), Collected()
            for rid, n in (("a", 1000), ("b", 30), ("c", 30)):
                submit(b, c, rid, n)
            await until(lambda: len(c.outs["a"]) > 0)
            t0 = time.monotonic()
            b.abort("a")
            await until(lambda: "a" in engine.aborted, 1.0)
            assert time.monotonic() - t0 < 0.5
            await c.wait("b", "c")
            assert c.tokens("b") == list(range(30)) and c.tokens("c") == list(range(30))
            assert not c.done["a"].is_set(), "an aborted request says nothing more"
            await b.close("test over")

    run(body())


def test_the_streams_end_aborts_every_request_it_carried():
    async def body() -> None:
        engine = ScriptedEngine(tick_s=0.005)
        async with worker(engine) as (url, wapi), aiohttp.ClientSession() as s:
            b, c = backend(s, [url]), Collected()
            submit(b, c, "x", 1000)
            submit(b, c, "y", 1000)
            await until(lambda: c.outs["x"] and c.outs["y"])
            await b.channels[url].close()  # as if the router's side of the stream broke
            await c.wait("x", "y")
            for rid in ("x", "y"):
                assert c.finish(rid).finish_reason == "error"
                assert url in (c.finish(rid).error or "")
            await until(lambda: {"x", "y"} <= set(engine.aborted), 2.0)
            await until(lambda: len(wapi.channels) == 0, 2.0)
            await b.close("test over")

    run(body())


def test_a_stopping_worker_ends_its_idle_channel_and_new_requests_go_elsewhere():
    async def body() -> None:
        ea, eb = ScriptedEngine(), ScriptedEngine()
        async with (
            worker(ea) as (ua, wa),
            worker(eb) as (ub, _),
            aiohttp.ClientSession() as s,
        ):
            b, c = backend(s, [ua, ub]), Collected()
            submit(b, c, "first-a", 3)
            submit(b, c, "first-b", 3)
            await c.wait("first-a", "first-b")
            assert ea.submitted == ["first-a"]
            wa.channels.stop()
            await until(lambda: b.channels[ua].id is None, 2.0)  # ended, quietly
            for i in range(4):
                submit(b, c, f"later{i}", 3)
            await c.wait(*(f"later{i}" for i in range(4)))
            assert all(c.finish(f"later{i}").finish_reason == "length" for i in range(4))
            assert ea.submitted == ["first-a"], "a stopping worker took a new request"
            assert len(eb.submitted) == 5
            await b.close("test over")

    run(body())


def test_a_stopping_worker_finishes_what_its_channel_carries_then_ends_it():
    async def body() -> None:
        engine = ScriptedEngine(tick_s=0.005)
        async with worker(engine) as (url, wapi), aiohttp.ClientSession() as s:
            b, c = backend(s, [url]), Collected()
            submit(b, c, "long", 40)
            await until(lambda: len(c.outs["long"]) > 3)
            wapi.channels.stop()
            assert [{**x, "id": 0} for x in wapi.channels.snapshot()] == [
                {"id": 0, "requests": 1, "ending": True}
            ]
            assert b.channels[url].snapshot()["requests"] == 1
            await c.wait("long")
            assert c.tokens("long") == list(range(40))
            assert c.finish("long").finish_reason == "length"
            await until(lambda: len(wapi.channels) == 0, 2.0)
            await b.close("test over")

    run(body())


def test_failing_the_channels_ends_each_request_with_the_reason():
    async def body() -> None:
        engine = ScriptedEngine(tick_s=0.005)
        async with worker(engine) as (url, wapi), aiohttp.ClientSession() as s:
            b, c = backend(s, [url]), Collected()
            submit(b, c, "p", 1000)
            submit(b, c, "q", 1000)
            await until(lambda: c.outs["p"] and c.outs["q"])
            assert wapi.channels.fail_all("the worker is shutting down") == 2
            await c.wait("p", "q")
            for rid in ("p", "q"):
                f = c.finish(rid)
                assert f.finish_reason == "error" and f.error == "the worker is shutting down"
            assert {"p", "q"} <= set(engine.aborted)
            await until(lambda: len(wapi.channels) == 0, 2.0)
            await b.close("test over")

    run(body())


def test_an_engine_that_never_finishes_is_timed_out_by_the_worker(monkeypatch):
    monkeypatch.setattr(api_mod, "STREAM_GRACE_S", 0.2)

    async def body() -> None:
        engine = ScriptedEngine(frozen=True)
        async with worker(engine) as (url, _), aiohttp.ClientSession() as s:
            b, c = backend(s, [url]), Collected()
            submit(b, c, "stuck", 5, timeout_s=0.3)
            await c.wait("stuck", timeout_s=4.0)  # the router's own wait is 5 s longer
            assert c.finish("stuck").finish_reason == "error"
            assert c.finish("stuck").error == TIMED_OUT
            assert "stuck" in engine.aborted
            await b.close("test over")

    run(body())


@pytest.mark.parametrize(
    ("path", "body", "status", "code_or_param"),
    [
        ("/outputs", {"channel": 5}, 400, "channel"),
        ("/outputs", {"channel": "c", "x": 1}, 400, "channel"),
        ("/outputs", ["c"], 400, "channel"),
        ("/generate", {"request_id": "r", "prompt_ids": [1], "channel": "nope"}, 503, None),
        ("/generate", {"request_id": "r", "prompt_ids": [1], "channel": ""}, 400, "channel"),
    ],
)
def test_channel_requests_are_checked(path, body, status, code_or_param):
    async def main() -> None:
        async with (
            worker(ScriptedEngine()) as (url, _),
            aiohttp.ClientSession() as s,
            s.post(url + path, json=body) as r,
        ):
            assert r.status == status
            err = (await r.json())["error"]
            if status == 400:
                assert err["param"] == code_or_param
            else:
                assert err["code"] == "channel_closed" and err["type"] == "server_error"

    run(main())


def test_a_channel_id_and_a_request_id_on_it_are_taken_once():
    async def main() -> None:
        async with (
            worker(ScriptedEngine(frozen=True)) as (url, _),
            aiohttp.ClientSession() as s,
            s.post(url + "/outputs", json={"channel": "one"}) as stream,
        ):
            assert stream.status == 200
            async with s.post(url + "/outputs", json={"channel": "one"}) as again:
                assert again.status == 409
                assert (await again.json())["error"]["code"] == "duplicate_id"
            gen = {"request_id": "r", "prompt_ids": [1], "channel": "one"}
            async with s.post(url + "/generate", json=gen) as r:
                assert r.status == 200 and await r.json() == {"ok": True}
            async with s.post(url + "/generate", json=gen) as r:
                assert r.status == 409
                assert (await r.json())["error"]["code"] == "duplicate_id"

    run(main())


def test_encode_burst_merges_each_request_in_order_and_never_past_a_finish():
    outs = [
        RequestOutput("r1", (1,)),
        RequestOutput("r2", (7,)),
        RequestOutput("r1", (2, 3), (), "stop"),
        RequestOutput("r2", (8,)),
        RequestOutput("r1", (4,)),  # after r1's finish: stays apart
    ]
    lines = [decode_output(ln) for ln in encode_burst(outs).splitlines()]
    assert [(o.request_id, o.token_ids, o.finish_reason) for o in lines] == [
        ("r1", (1, 2, 3), "stop"),
        ("r1", (4,), None),
        ("r2", (7, 8), None),
    ]
    single = [RequestOutput("a", (1,)), RequestOutput("b", (2,))]
    assert encode_burst(single) == encode_line(single[0]) + encode_line(single[1])


def test_the_canary_goes_the_way_client_requests_go():
    async def body() -> None:
        engine = ScriptedEngine()
        async with worker(engine) as (url, wapi), aiohttp.ClientSession() as s:
            b = backend(s, [url])
            monitor = HealthMonitor(b.cfg, b.registry, b.clients, b.metrics, [1, 2], b.run_once)
            result = await monitor.probe((None, url))
            assert result["ok"], result
            assert engine.submitted[0].startswith("deep-health-")
            assert b.channels[url].opened == 1 and len(wapi.channels) == 1  # on the channel
            assert b.registry.decode[0].routed == 0  # not counted as a client request
            engine.frozen = True  # the engine stops answering: the canary says so
            monitor.cfg = dataclasses.replace(b.cfg, deep_timeout_s=0.3)
            result = await monitor.probe((None, url))
            assert not result["ok"] and "did not finish within 0.3s" in result["error"]
            await until(lambda: any(r.startswith("deep-health-") for r in engine.aborted), 2.0)
            await b.close("test over")

    run(body())


def test_a_request_the_engine_refuses_on_a_channel_is_400_and_leaves_no_trace():
    """The engine's own check runs in its `submit`: a prompt it can never serve is a 400 naming
    the field, and the channel forgets the id, which may then come again (worker/http/api.py)."""

    async def main() -> None:
        engine = ScriptedEngine(frozen=True)
        async with (
            worker(engine) as (url, _),
            aiohttp.ClientSession() as s,
            s.post(url + "/outputs", json={"channel": "one"}) as stream,
        ):
            assert stream.status == 200
            bad = {"request_id": "r", "prompt_ids": [engine.vocab_size], "channel": "one"}
            async with s.post(url + "/generate", json=bad) as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == "prompt"
            good = {**bad, "prompt_ids": [1]}
            async with s.post(url + "/generate", json=good) as r:
                assert r.status == 200 and await r.json() == {"ok": True}
            assert engine.submitted == ["r"]

    run(main())
