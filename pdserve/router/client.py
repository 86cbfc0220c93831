"""The router's client for one worker's HTTP API (the contract is in pdserve/worker/http/api.py).

Every call carries its own bounded timeout. A failure raises WorkerError, which names the
worker and says what happened: the worker refused the connection, answered with an HTTP
error, broke its stream, or did not answer in time. `connect=True` marks failures where the
request never reached the worker, so it is safe to send it somewhere else.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp

from pdserve.protocol.generate import Generate, encode_generate
from pdserve.protocol.outputs import RequestOutput, decode_line, decode_output

ERROR_BODY_LIMIT = 2000  # characters of a worker's error body worth quoting
MAX_LINE_BYTES = 256 * 2**20  # one /generate line at most (prompt logprobs can be large)
JSON_HEADERS = {"Content-Type": "application/json"}


class WorkerError(Exception):
    """`connect`: the request surely never reached the engine (it may go elsewhere);
    `mark_down`: and the worker looks gone (out of rotation until its next good health
    poll: a refused connection); `status` and `code`: the worker's HTTP answer, if any."""

    def __init__(
        self,
        url: str,
        what: str,
        connect: bool = False,
        *,
        mark_down: bool | None = None,
        status: int | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(f"worker {url}: {what}")
        self.url, self.what, self.connect = url, what, connect
        self.mark_down = connect if mark_down is None else mark_down
        self.status, self.code = status, code


class WorkerClient:
    def __init__(self, session: aiohttp.ClientSession, url: str, connect_timeout_s: float) -> None:
        self.session = session
        self.url = url.rstrip("/")
        self.connect_timeout_s = connect_timeout_s

    def _encode(self, body: Generate) -> bytes:
        """A /generate body as JSON (protocol/generate.py); WorkerError (the request never
        left) if it cannot be."""
        try:
            return encode_generate(body)
        except (TypeError, ValueError, OverflowError) as e:  # a lone surrogate, a huge int
            raise WorkerError(self.url, f"the /generate body cannot be encoded: {e}") from e

    def _timeout(self, total_s: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(
            total=total_s, sock_connect=min(self.connect_timeout_s, total_s)
        )

    async def get_json(self, path: str, timeout_s: float) -> Any:
        """GET path; the parsed body of a 200, WorkerError for anything else."""
        try:
            async with self.session.get(self.url + path, timeout=self._timeout(timeout_s)) as r:
                if r.status != 200:
                    raise WorkerError(
                        self.url, f"GET {path} answered HTTP {r.status}: {await _error_text(r)}"
                    )
                return await r.json(content_type=None)
        except aiohttp.ClientConnectorError as e:
            raise WorkerError(self.url, f"GET {path}: cannot connect: {e}", connect=True) from e
        except TimeoutError as e:
            raise WorkerError(self.url, f"GET {path}: no answer within {timeout_s:.1f}s") from e
        except aiohttp.ClientError as e:
            raise WorkerError(self.url, f"GET {path} failed: {e!r}") from e
        except ValueError as e:
            raise WorkerError(self.url, f"GET {path} answered with a body that is not JSON") from e

    async def info(self, timeout_s: float) -> dict[str, Any]:
        info = await self.get_json("/info", timeout_s)
        if not isinstance(info, dict):
            raise WorkerError(self.url, f"GET /info answered {str(info)[:200]!r}, not an object")
        return info

    async def health(self, timeout_s: float) -> None:
        await self.get_json("/health", timeout_s)

    async def abort(self, request_ids: Sequence[str], timeout_s: float) -> None:
        """POST /abort for these requests (at most MAX_ABORT_IDS: worker/http/api.py)."""
        if isinstance(request_ids, str):
            raise TypeError("abort() takes a list of request ids, not one id")
        body = {"request_ids": list(request_ids)}
        try:
            async with self.session.post(
                self.url + "/abort", json=body, timeout=self._timeout(timeout_s)
            ) as r:
                if r.status != 200:
                    raise WorkerError(
                        self.url, f"POST /abort answered HTTP {r.status}: {await _error_text(r)}"
                    )
        except TimeoutError as e:
            raise WorkerError(self.url, f"POST /abort: no answer within {timeout_s:.1f}s") from e
        except aiohttp.ClientError as e:
            raise WorkerError(self.url, f"POST /abort failed: {e!r}") from e

    async def generate(self, body: Generate, timeout_s: float) -> AsyncIterator[RequestOutput]:
        """POST /generate and yield its outputs; the last one yielded carries a finish_reason.

        Anything short of that (HTTP error, broken or malformed stream, no end within
        timeout_s) raises WorkerError. Closing the generator early closes the connection,
        which the worker takes as an abort.
        """
        rid = body.request_id
        try:
            async with self.session.post(
                self.url + "/generate",
                data=self._encode(body),
                headers=JSON_HEADERS,
                timeout=self._timeout(timeout_s),
            ) as r:
                if r.status != 200:
                    raise WorkerError(
                        self.url, f"POST /generate answered HTTP {r.status}: {await _error_text(r)}"
                    )
                async for lines in read_lines(r.content):
                    for raw in lines:
                        out = decode_line(raw, rid)
                        yield out
                        if out.finish_reason is not None:
                            return
            raise WorkerError(self.url, "the /generate stream ended without a finish_reason")
        except aiohttp.ClientConnectorError as e:
            raise WorkerError(self.url, f"POST /generate: cannot connect: {e}", connect=True) from e
        except TimeoutError as e:
            raise WorkerError(
                self.url, f"POST /generate: the stream did not finish within {timeout_s:.1f}s"
            ) from e
        except aiohttp.ClientError as e:
            raise WorkerError(self.url, f"POST /generate: the connection failed: {e!r}") from e
        except ValueError as e:  # a malformed line (decode_line), a line over MAX_LINE_BYTES
            raise WorkerError(self.url, f"POST /generate sent a bad stream: {e}") from e

    async def submit(self, body: Generate, timeout_s: float) -> None:
        """POST /generate with a "channel": returns once the worker's engine has the request.

        WorkerError with connect=True when the request surely never reached the engine: the
        connection was refused, or the worker answered 503 (its `code` says why:
        `channel_closed`, the channel is gone; `shutting_down`), so it may go elsewhere.
        """
        try:
            async with self.session.post(
                self.url + "/generate",
                data=self._encode(body),
                headers=JSON_HEADERS,
                timeout=self._timeout(timeout_s),
            ) as r:
                if r.status != 200:
                    text, code = await _error_body(r)
                    raise WorkerError(
                        self.url,
                        f"POST /generate answered HTTP {r.status}: {text}",
                        r.status == 503,
                        mark_down=r.status == 503 and code != "channel_closed",
                        status=r.status,
                        code=code,
                    )
        except aiohttp.ClientConnectorError as e:
            raise WorkerError(self.url, f"POST /generate: cannot connect: {e}", connect=True) from e
        except TimeoutError as e:
            raise WorkerError(self.url, f"POST /generate: no answer within {timeout_s:.1f}s") from e
        except aiohttp.ClientError as e:
            raise WorkerError(self.url, f"POST /generate failed: {e!r}") from e

    async def outputs(
        self, channel_id: str, open_timeout_s: float, silence_s: float
    ) -> AsyncIterator[list[RequestOutput]]:
        """POST /outputs: the worker's shared output stream for `channel_id`, as the outputs
        each read brought. The first item is [] once the worker has answered 200 within
        `open_timeout_s` (the channel is open: requests may name it). It ends when the worker
        ends the stream; anything else raises WorkerError (connect=True if it never opened:
        refused, or 503), nothing read for `silence_s` included (the worker writes a blank
        line when it has had nothing to say for a while: worker/http/channels.py)."""

        async def answer() -> aiohttp.ClientResponse:
            r = await self.session.post(
                self.url + "/outputs",
                json={"channel": channel_id},
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    sock_connect=min(self.connect_timeout_s, open_timeout_s),
                    sock_read=silence_s,
                ),
            )
            if r.status != 200:
                try:
                    text, code = await _error_body(r)
                finally:
                    r.close()
                raise WorkerError(
                    self.url,
                    f"POST /outputs answered HTTP {r.status}: {text}",
                    connect=r.status == 503,
                    status=r.status,
                    code=code,
                )
            return r

        opened = False
        try:
            async with asyncio.timeout(open_timeout_s):
                r = await answer()
            try:
                opened = True
                yield []
                async for lines in read_lines(r.content):
                    yield [decode_output(raw) for raw in lines]
            finally:
                r.close()  # not back to the pool: a stream cut short leaves the socket unusable
        except aiohttp.ClientConnectorError as e:
            raise WorkerError(self.url, f"POST /outputs: cannot connect: {e}", connect=True) from e
        except TimeoutError as e:
            what = "nothing for" if opened else "no answer within"
            limit = silence_s if opened else open_timeout_s
            raise WorkerError(
                self.url, f"POST /outputs: {what} {limit:.1f}s", connect=not opened
            ) from e
        except aiohttp.ClientError as e:
            raise WorkerError(self.url, f"POST /outputs: the connection failed: {e!r}") from e
        except ValueError as e:  # a malformed line (decode_output), a line over MAX_LINE_BYTES
            raise WorkerError(self.url, f"POST /outputs sent a bad stream: {e}") from e


async def read_lines(content: aiohttp.StreamReader) -> AsyncIterator[list[bytes]]:
    """The non-blank lines of an NDJSON body, as many as each read brought (a burst of lines
    costs one await, not one readline each); a last line without its newline comes at the
    end. ValueError for a line over MAX_LINE_BYTES."""
    parts: list[bytes] = []  # the line not yet complete
    size = 0
    async for piece in content.iter_any():
        if b"\n" not in piece:
            parts.append(piece)
            size += len(piece)
            if size > MAX_LINE_BYTES:
                raise ValueError(f"a line longer than {MAX_LINE_BYTES} bytes")
            continue
        *lines, rest = piece.split(b"\n")
        if parts:
            lines[0] = b"".join(parts) + lines[0]
        parts, size = [rest], len(rest)
        yield [raw for raw in lines if raw.strip()]
    last = b"".join(parts)
    if last.strip():
        yield [last]


async def _error_text(r: aiohttp.ClientResponse) -> str:
    """The worker's error message, from an OpenAI-style body when there is one."""
    return (await _error_body(r))[0]


async def _error_body(r: aiohttp.ClientResponse) -> tuple[str, str | None]:
    """(the worker's error message, its code), from an OpenAI-style body when there is one."""
    try:
        text = (await r.text())[:ERROR_BODY_LIMIT]
    except (aiohttp.ClientError, UnicodeDecodeError) as e:
        return f"(unreadable body: {e!r})", None
    try:
        err = json.loads(text)["error"]
        code = err.get("code")
        return str(err["message"]), code if isinstance(code, str) else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return text, None
