"""Client-caused failures answer 4xx, never 5xx (issue 41 item 6): a malformed gzip body, a
deflate bomb, an Authorization header that is not UTF-8. Each goes through a real aiohttp app
(the OpenAI and worker routes over a fake engine, the error middleware and the auth gate),
served both by aiohttp's own runner (the app's handler_args) and by our Listener (its
Connection), the way every pdserve process serves; each answer is an OpenAI-style error body
and nothing is logged with a traceback. The fourth case, a tiny timeout in PD mode, is in
tests/worker/test_decode_deadline.py and tests/router/test_router_pd.py.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import logging
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pdserve.frontend.api import OpenAIApi
from pdserve.runtime.cluster_key import ClusterKey, bearer_matches
from pdserve.server.api_error import ApiError
from pdserve.server.auth import Gate
from pdserve.server.body import (
    INFLATE_FLOOR,
    INFLATE_RATIO,
    INFLATE_STEP,
    MAX_BODY_BYTES,
    app_args,
    inflate,
    inflate_bound,
)
from pdserve.server.errors import error_middleware
from pdserve.server.listener import HttpLimits, Listener, bind
from pdserve.worker.http.api import WorkerApi
from tests.server.validation_app import MAX_LEN, FakeEngine, FakeTokenizer

API_KEY = "sk-client-faults-1234"
CLUSTER = ClusterKey(bytes(range(40, 72)))
LIMIT = MAX_BODY_BYTES  # the apps' body limit, as in production
PLAIN = json.dumps({"prompt": "hello there", "max_tokens": 2}).encode()
BOMB = zlib.compress(b'{"prompt": "' + b"a" * (200 * 2**20) + b'"}', 9)  # ~200 KB
ERROR_KEYS = {"message", "type", "param", "code"}


def make_app(api_key: str | None = None, cluster: ClusterKey | None = None) -> web.Application:
    gate = Gate(api_key, cluster)
    app = web.Application(middlewares=[error_middleware(), gate.middleware()], **app_args(LIMIT))
    engine = FakeEngine()
    app.add_routes(OpenAIApi(engine, FakeTokenizer(), "m", MAX_LEN, 5.0).routes())
    app.add_routes(WorkerApi(engine, "decode", "m", {}).routes())
    return app


@asynccontextmanager
async def aiohttp_runner(app: web.Application) -> AsyncIterator[str]:
    async with TestServer(app) as server:
        yield str(server.make_url("")).rstrip("/")


@asynccontextmanager
async def pdserve_listener(app: web.Application) -> AsyncIterator[str]:
    listener = Listener(bind("127.0.0.1", 0), HttpLimits())
    app.middlewares.insert(0, listener.middleware())
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1)
    await runner.setup()
    await listener.start(runner)
    try:
        yield f"http://127.0.0.1:{listener.port}"
    finally:
        listener.stop_accepting()
        await runner.cleanup()


SERVERS = {"aiohttp-runner": aiohttp_runner, "pdserve-listener": pdserve_listener}
Serving = Callable[[web.Application], Any]


def post_all(serving: Serving, calls: list[tuple[str, bytes, dict[str, str]]]) -> list[Any]:
    """(status, JSON body) per (path, body, headers), each POSTed by aiohttp's client."""

    async def go() -> list[Any]:
        out = []
        async with serving(make_app()) as base, aiohttp.ClientSession() as session:
            for path, data, headers in calls:
                headers = {"Content-Type": "application/json", **headers}
                async with session.post(base + path, data=data, headers=headers) as r:
                    out.append((r.status, await r.json(content_type=None)))
        return out

    return asyncio.run(go())


def assert_openai_error(answer: Any, status: int, code: str | None) -> None:
    got, body = answer
    assert got == status, answer
    assert set(body["error"]) == ERROR_KEYS and body["error"]["message"], body
    assert body["error"]["code"] == code, body


def no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("server", list(SERVERS))
def test_compressed_bodies_inflate_or_are_refused_with_4xx(server, caplog):
    gz = gzip.compress(PLAIN)
    calls = [
        ("/v1/completions", gz, {"Content-Encoding": "gzip"}),
        ("/v1/completions", zlib.compress(PLAIN), {"Content-Encoding": "deflate"}),
        ("/v1/completions", PLAIN, {"Content-Encoding": "identity"}),
        ("/v1/completions", b"\x1f\x8b\x08\x00garbage!", {"Content-Encoding": "gzip"}),
        ("/v1/completions", gz[:-12], {"Content-Encoding": "gzip"}),  # cut short
        ("/v1/completions", gz + b"junk", {"Content-Encoding": "gzip"}),
        ("/generate", b"not gzip at all", {"Content-Encoding": "gzip"}),  # the worker API too
        ("/v1/completions", BOMB, {"Content-Encoding": "deflate"}),
        ("/v1/completions", PLAIN, {"Content-Encoding": "br"}),
        ("/v1/completions", PLAIN, {"Content-Encoding": "gzip, deflate"}),
    ]
    with caplog.at_level(logging.DEBUG):
        answers = post_all(SERVERS[server], calls)
    for served in answers[:3]:
        assert served[0] == 200 and served[1]["choices"][0]["finish_reason"] == "length", served
    for broken in answers[3:7]:
        assert_openai_error(broken, 400, "invalid_content_encoding")
    assert "not valid gzip" in answers[3][1]["error"]["message"]
    assert "cut short" in answers[4][1]["error"]["message"]
    assert_openai_error(answers[7], 413, "body_too_large")
    assert f"{INFLATE_RATIO} times its compressed size" in answers[7][1]["error"]["message"]
    assert_openai_error(answers[8], 415, "unsupported_content_encoding")
    assert_openai_error(answers[9], 415, "unsupported_content_encoding")
    no_traceback(caplog)


def test_a_bomb_is_refused_before_it_inflates_past_its_bound():
    bound = inflate_bound(len(BOMB), 64 * 2**20)
    assert bound == INFLATE_RATIO * len(BOMB) < 64 * 2**20  # ~10 MB, not 64 MiB
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        with pytest.raises(ApiError) as e:
            asyncio.run(inflate(BOMB, "deflate", 64 * 2**20))
        took = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert e.value.status == 413
    assert peak < bound * 5 // 4 + 2 * INFLATE_STEP, peak  # the output as it grows, one step
    assert took < 2.0, took
    # The body limit binds where the ratio would allow more; a small body may always reach
    # the floor, whatever its ratio.
    assert inflate_bound(10 * 2**20, 64 * 2**20) == 64 * 2**20
    assert inflate_bound(100, 64 * 2**20) == INFLATE_FLOOR


def test_inflate_takes_every_gzip_member_and_both_deflate_forms():
    two = gzip.compress(PLAIN[:7]) + gzip.compress(PLAIN[7:])
    assert asyncio.run(inflate(two, "gzip", LIMIT)) == PLAIN
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert asyncio.run(inflate(raw.compress(PLAIN) + raw.flush(), "deflate", LIMIT)) == PLAIN
    assert asyncio.run(inflate(zlib.compress(PLAIN), "deflate", LIMIT)) == PLAIN


def raw_get(base: str, path: str, authorization: bytes) -> tuple[int, Any]:
    """GET with an Authorization header of these exact bytes (http.client writes latin-1;
    aiohttp's client would write UTF-8)."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.putrequest("GET", path)
        conn.putheader("Authorization", authorization)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


@pytest.mark.parametrize("server", list(SERVERS))
def test_an_authorization_header_that_is_not_utf8_is_a_401(server, caplog):
    headers = [b"Bearer \xff\xfe", b"Bearer caf\xe9", b"Bearer \xed\xa0\x80", b"Bearer"]
    paths = ["/v1/models", "/info", "/generate"]  # the API key's check, the cluster key's

    async def go() -> list[tuple[int, Any]]:
        async with SERVERS[server](make_app(API_KEY, CLUSTER)) as base:
            calls = [(base, p, h) for p in paths for h in headers]
            return [await asyncio.to_thread(raw_get, *c) for c in calls]

    with caplog.at_level(logging.DEBUG):
        answers = asyncio.run(go())
    for answer in answers:
        assert answer[0] == 401, answer
        assert set(answer[1]["error"]) == ERROR_KEYS
        assert answer[1]["error"]["type"] == "authentication_error"
    no_traceback(caplog)


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (f"Bearer {API_KEY}", True),
        (f"Bearer {API_KEY} ", False),
        ("Bearer \udcff\udcfe", False),  # how aiohttp hands over bytes that are not UTF-8
        ("Bearer \ud800", False),  # a lone surrogate of any kind
        ("Bearer café", False),
        ("bearer " + API_KEY, False),
        (None, False),
    ],
)
def test_bearer_matches_any_string_without_raising(header, ok):
    assert bearer_matches(header, API_KEY) is ok
    assert CLUSTER.http_ok(header) is False
