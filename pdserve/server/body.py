"""A request's body: read within a time and a size, and inflated by us, bounded while inflating.

aiohttp inflates a `Content-Encoding: gzip|deflate` body itself, in its HTTP parser, before a
handler sees it: a malformed stream surfaced as a bare exception (a 500 with a traceback), and
`request.read()` asks the parser for chunks as large as the whole size limit, so a 200 KB
deflate bomb became 64 MiB of memory before the 413. So every app that reads bodies is built
with `app_args()`, which turns aiohttp's inflation off, and `read_body` does it here:

* no Content-Encoding, or `identity`: the bytes as sent, at most the app's `client_max_size`
  (aiohttp's own 413 past it);
* `gzip` (one or more members) or `deflate` (zlib-wrapped as RFC 9110 says, or raw, as some
  clients send): inflated in steps of INFLATE_STEP bytes with zlib's `max_length`, the event
  loop served between steps, and refused (413) as soon as the output passes
  `min(client_max_size, max(INFLATE_FLOOR, INFLATE_RATIO x the compressed size))`: a body
  can never cost more memory than the limit, nor much more than its own size times the ratio
  (the idea of Apache mod_deflate's DeflateInflateRatioLimit). A stream zlib cannot read, or
  one cut short or followed by other bytes, is a 400;
* any other coding (br, zstd, compress, a list of codings): 415, naming the ones we take.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

from aiohttp import hdrs, web

from pdserve.protocol.sampling import show
from pdserve.runtime.timing import BODY_TIMEOUT_S
from pdserve.server.api_error import ApiError

MAX_BODY_BYTES = 64 * 2**20  # a request body, as sent and once inflated
INFLATE_RATIO = 50  # JSON compresses 3-10x; a bomb, ~1000x
INFLATE_FLOOR = 2**20  # a small body may inflate this far whatever its ratio
INFLATE_STEP = 2**20  # bytes inflated between two turns of the event loop
CODINGS = ("gzip", "deflate")  # what read_body inflates ("x-gzip" is gzip: RFC 9110 8.4.1.3)


def app_args(max_body: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """web.Application's keyword arguments for an app whose handlers call `read_body`: its
    size limit, and aiohttp's own inflation off (handler_args reach the HTTP parser whichever
    runner serves the app: our Listener, or aiohttp's TestServer)."""
    return {"client_max_size": max_body, "handler_args": {"auto_decompress": False}}


async def read_body(request: web.Request) -> bytes:
    """The request's body, inflated. 408 if it has not arrived within BODY_TIMEOUT_S; 413 past
    the app's client_max_size (aiohttp's HTTPException, which the error middleware answers)
    or past the inflation bound; 415 for a coding we do not take; 400 for a broken stream."""
    coding = content_coding(request.headers.get(hdrs.CONTENT_ENCODING))
    try:
        # asyncio.timeout, not wait_for: wait_for can swallow the cancel of a handler whose
        # client went away as the read completes (LESSONS #17).
        async with asyncio.timeout(BODY_TIMEOUT_S):
            raw = await request.read()
    except TimeoutError as e:
        raise ApiError(
            408,
            f"the request body did not arrive within {BODY_TIMEOUT_S:.0f}s",
            type_="timeout_error",
            code="body_timeout",
        ) from e
    if coding is None:
        return raw
    return await inflate(raw, coding, request.client_max_size)


def content_coding(header: str | None) -> str | None:
    """The one coding to undo (`gzip` or `deflate`), None for none; 415 for anything else."""
    names = [c.strip().lower() for c in (header or "").split(",")]
    names = [c for c in names if c not in ("", "identity")]
    names = ["gzip" if c == "x-gzip" else c for c in names]
    if not names:
        return None
    if len(names) == 1 and names[0] in CODINGS:
        return names[0]
    raise ApiError(
        415,
        f"Content-Encoding {show(header)} is not supported: send the body as is, or with one "
        f"of {', '.join(CODINGS)}",
        param="Content-Encoding",
        code="unsupported_content_encoding",
    )


def inflate_bound(compressed: int, limit: int) -> int:
    """How many bytes a body of `compressed` bytes may inflate to, under a `limit` that a plain
    body has too (0: none, as aiohttp's client_max_size)."""
    by_ratio = max(INFLATE_FLOOR, INFLATE_RATIO * compressed)
    return min(limit, by_ratio) if limit > 0 else by_ratio


async def inflate(raw: bytes, coding: str, limit: int) -> bytes:
    """`raw` inflated; never more than inflate_bound(len(raw), limit) + 1 bytes are made."""
    bound = inflate_bound(len(raw), limit)
    d = _decompressor(coding, raw)
    out = bytearray()
    data = raw
    try:
        while True:
            piece = d.decompress(data, min(INFLATE_STEP, bound + 1 - len(out)))
            out += piece
            if len(out) > bound:
                raise _too_large(len(raw), bound, limit)
            if d.eof:
                if not d.unused_data:
                    return bytes(out)
                if coding != "gzip":
                    raise _broken(coding, "bytes follow the end of the stream")
                data, d = d.unused_data, _decompressor(coding, d.unused_data)  # next member
            else:
                data = d.unconsumed_tail
                if not data and not piece:
                    raise _broken(coding, "the stream is cut short")
            await asyncio.sleep(0)  # a large body inflates without stalling other requests
    except zlib.error as e:
        raise _broken(coding, str(e)) from e


def _decompressor(coding: str, head: bytes) -> Any:  # zlib's type has no public name
    if coding == "gzip":
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    # RFC 1950's two header bytes: deflate with a window, a multiple of 31. Anything else is
    # taken for a raw RFC 1951 stream, which is what some clients send as "deflate".
    wrapped = len(head) >= 2 and head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0
    return zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)


def _broken(coding: str, why: str) -> ApiError:
    return ApiError(
        400,
        f"the request body is not valid {coding} (Content-Encoding): {why}",
        param="Content-Encoding",
        code="invalid_content_encoding",
    )


def _too_large(compressed: int, bound: int, limit: int) -> ApiError:
    why = (
        f"the limit of {limit} bytes"
        if bound == limit
        else f"{INFLATE_RATIO} times its compressed size of {compressed} bytes"
    )
    return ApiError(
        413,
        f"the request body inflates past {bound} bytes ({why}); send it uncompressed",
        param="Content-Encoding",
        code="body_too_large",
    )
