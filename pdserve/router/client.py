"""The router's client for one worker's HTTP API (the contract is in pdserve/worker/api.py).

Every call carries its own bounded timeout. A failure raises WorkerError, which names the
worker and says what happened: the worker refused the connection, answered with an HTTP
error, broke its stream, or did not answer in time. `connect=True` marks failures where the
request never reached the worker, so it is safe to send it somewhere else.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from pdserve.protocol.outputs import RequestOutput, decode_line

ERROR_BODY_LIMIT = 2000  # characters of a worker's error body worth quoting
MAX_LINE_BYTES = 256 * 2**20  # one /generate line at most (prompt logprobs can be large)


class WorkerError(Exception):
    def __init__(self, url: str, what: str, connect: bool = False) -> None:
        super().__init__(f"worker {url}: {what}")
        self.url, self.what, self.connect = url, what, connect


class WorkerClient:
    def __init__(self, session: aiohttp.ClientSession, url: str, connect_timeout_s: float) -> None:
        self.session = session
        self.url = url.rstrip("/")
        self.connect_timeout_s = connect_timeout_s

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

    async def abort(self, request_id: str, timeout_s: float) -> None:
        body = {"request_id": request_id}
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

    async def generate(
        self, body: dict[str, Any], timeout_s: float
    ) -> AsyncIterator[RequestOutput]:
        """POST /generate and yield its outputs; the last one yielded carries a finish_reason.

        Anything short of that (HTTP error, broken or malformed stream, no end within
        timeout_s) raises WorkerError. Closing the generator early closes the connection,
        which the worker takes as an abort.
        """
        rid = str(body["request_id"])
        try:
            async with self.session.post(
                self.url + "/generate", json=body, timeout=self._timeout(timeout_s)
            ) as r:
                if r.status != 200:
                    raise WorkerError(
                        self.url, f"POST /generate answered HTTP {r.status}: {await _error_text(r)}"
                    )
                # Read whatever arrived and split it here: a burst of lines costs one await,
                # not one readline each.
                parts: list[bytes] = []  # the line not yet complete
                size = 0
                async for piece in r.content.iter_any():
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
                    for raw in lines:
                        if not raw.strip():
                            continue
                        out = decode_line(raw, rid)
                        yield out
                        if out.finish_reason is not None:
                            return
                last = b"".join(parts)  # a last line without its newline
                if last.strip():
                    out = decode_line(last, rid)
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


async def _error_text(r: aiohttp.ClientResponse) -> str:
    """The worker's error message, from an OpenAI-style body when there is one."""
    try:
        text = (await r.text())[:ERROR_BODY_LIMIT]
    except (aiohttp.ClientError, UnicodeDecodeError) as e:
        return f"(unreadable body: {e!r})"
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text
