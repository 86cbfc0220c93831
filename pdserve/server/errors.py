"""The error middleware: every failure of an aiohttp app becomes an OpenAI-style JSON body.

Without it aiohttp answers an uncaught exception with a plain-text 500 and its own
HTTPExceptions (404, 405, 413 from `request.read()`) with plain text, which OpenAI clients
cannot parse. With it:

* a response a handler returns passes through untouched;
* an HTTPException of status >= 400 becomes {"error": {...}} with that status, keeping its
  headers (Allow on a 405);
* any other exception is logged with its traceback and answered with a JSON 500 whose body
  says only "internal error (logged)": no traceback, no file path;
* once a response has started (a stream), no second response can be sent: the connection is
  closed, which is what a client sees of a stream that broke;
* a ConnectionError once the client went away (its transport closing) is not an error:
  logged at debug level, and nothing is answered. asyncio.CancelledError (aiohttp cancels
  the handler of a client that disconnects) is never caught here.

aiohttp's own answer to an unparsable HTTP message (a 400 from its parser) happens before
any handler runs, so no middleware sees it.
"""

from __future__ import annotations

import logging

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware

from pdserve.server.api_error import ApiError

log = logging.getLogger(__name__)

INTERNAL_ERROR = "internal error (logged)"
_BODY_HEADERS = frozenset({hdrs.CONTENT_TYPE, hdrs.CONTENT_LENGTH, hdrs.CONTENT_ENCODING})


def error_middleware() -> Middleware:
    """The middleware for web.Application(middlewares=[error_middleware()])."""

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise  # a redirect is not an error
            if not _response_started(request):
                return _http_error(request, e)
            log.error("%s %s failed mid-response", request.method, request.path, exc_info=e)
            return _abandon(request)
        except Exception as e:  # noqa: BLE001 - the last line before a plain-text 500
            gone = _client_gone(request)
            if gone and isinstance(e, ConnectionError):
                log.debug("%s %s: the client went away (%r)", request.method, request.path, e)
                return _abandon(request)
            log.error("%s %s failed", request.method, request.path, exc_info=e)
            if gone or _response_started(request):
                return _abandon(request)
            return web.json_response(
                ApiError(500, INTERNAL_ERROR, type_="server_error").body(), status=500
            )

    return errors


def _http_error(request: web.Request, e: web.HTTPException) -> web.Response:
    if e.status == 404:
        message = f"Invalid URL ({request.method} {_short(request.path)})"
    elif e.status == 405:
        allowed = e.headers.get(hdrs.ALLOW, "")
        message = f"method {request.method} is not allowed for {_short(request.path)}"
        message += f"; allowed: {allowed}" if allowed else ""
    else:
        message = e.text or e.reason
    code = None
    if e.status == 413:  # the app's client_max_size, which this server sizes to its model
        limit = request.client_max_size
        message = f"the request body is larger than this server accepts ({limit} bytes)"
        code = "body_too_large"
    kind = "server_error" if e.status >= 500 else "invalid_request_error"
    headers = {k: v for k, v in e.headers.items() if k not in _BODY_HEADERS}
    return web.json_response(
        ApiError(e.status, message, type_=kind, code=code).body(),
        status=e.status,
        headers=headers,
    )


def _short(path: str, limit: int = 200) -> str:
    return path if len(path) <= limit else path[: limit - 3] + "..."


def _response_started(request: web.Request) -> bool:
    # aiohttp's own test before it answers an error (web_protocol.handle_error).
    return request.writer.output_size > 0


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _abandon(request: web.Request) -> web.StreamResponse:
    """Close the connection and return a response that cannot be sent: aiohttp's attempt to
    send it fails on the closed transport with a ConnectionError, which it takes quietly as
    a disconnect (where raising would log a second traceback, or write a second response
    into a stream whose headers are already out)."""
    transport = request.transport
    if transport is not None:
        transport.close()
    resp = web.Response(status=500)
    resp.force_close()
    return resp
