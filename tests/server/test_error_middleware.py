"""The error middleware (server/errors.py): a failure becomes an OpenAI-style JSON error, a
started stream is closed rather than replaced, and a client's disconnect is not an error.
Real aiohttp apps in this process (tests/server/test_validation.py's `exchange`).
"""

from __future__ import annotations

import asyncio
import logging
from unittest import mock

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from pdserve.server.errors import INTERNAL_ERROR, error_middleware
from tests.server.validation_app import Call, exchange


async def _boom(request: web.Request) -> web.Response:
    raise RuntimeError("secret detail in /srv/pdserve/thing.py")


async def _created(request: web.Request) -> web.Response:
    return web.Response(status=201, text="made", headers={"X-Kept": "1"})


async def _broken_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    await resp.prepare(request)
    await resp.write(b"partial")
    if request.query.get("http"):
        raise web.HTTPBadRequest(text="a second response would corrupt the stream")
    raise RuntimeError("after the headers")


def middleware_app() -> web.Application:
    app = web.Application(middlewares=[error_middleware()])
    app.add_routes(
        [
            web.post("/boom", _boom),
            web.get("/created", _created),
            web.get("/stream", _broken_stream),
        ]
    )
    return app


def test_middleware_turns_failures_into_json(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[Call] = [
        ("POST", "/boom", {}),
        ("GET", "/nope", b""),
        ("GET", "/boom", b""),
        ("GET", "/created", b""),
    ]
    with caplog.at_level(logging.ERROR, logger="pdserve.server.errors"):
        boom, missing, method, created = exchange(middleware_app(), calls)
    assert boom[0] == 500 and boom[1] == {
        "error": {"message": INTERNAL_ERROR, "type": "server_error", "param": None, "code": None}
    }
    [record] = [r for r in caplog.records if r.name == "pdserve.server.errors"]
    assert record.exc_info is not None and "secret detail" in str(record.exc_info[1])
    assert missing[0] == 404 and missing[1]["error"]["message"] == "Invalid URL (GET /nope)"
    assert missing[1]["error"]["type"] == "invalid_request_error"
    assert method[0] == 405 and "POST" in method[2]["Allow"]
    assert method[1]["error"]["type"] == "invalid_request_error"
    assert created[0] == 201 and created[1] == "made" and created[2]["X-Kept"] == "1"


@pytest.mark.parametrize("query", ["", "?http=1"])
def test_middleware_cannot_replace_a_started_stream_and_closes_it(query: str) -> None:
    async def go() -> bytes:
        async with TestClient(TestServer(middleware_app())) as client:
            r = await client.get("/stream" + query)
            assert r.status == 200
            return await r.read()

    with pytest.raises(aiohttp.ClientPayloadError):
        asyncio.run(go())


def test_middleware_keeps_a_client_disconnect_out_of_the_error_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def reset(request: web.Request) -> web.Response:
        raise ConnectionResetError("Cannot write to closing transport")

    async def go(closing: bool) -> web.StreamResponse:
        transport = mock.Mock()
        transport.is_closing.return_value = closing
        writer = mock.Mock(output_size=0)
        request = make_mocked_request("GET", "/x", transport=transport, writer=writer)
        return await error_middleware()(request, reset)

    with caplog.at_level(logging.DEBUG, logger="pdserve.server.errors"):
        asyncio.run(go(closing=True))
        assert [r.levelno for r in caplog.records] == [logging.DEBUG]
        caplog.clear()
        resp = asyncio.run(go(closing=False))  # not the client's doing: a server error
    assert resp.status == 500 and [r.levelno for r in caplog.records] == [logging.ERROR]
