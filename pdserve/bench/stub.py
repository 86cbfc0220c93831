"""A stub OpenAI server that answers every streamed completion at once, for testing clients.

It answers with a fixed SSE stream (N one-token chunks, a finish chunk, usage, [DONE]) built
once, so that the client is the only thing being measured: `benchmarks/serving/bench_overhead.py`
uses it to measure `pdserve bench`'s own requests/s. A prompt that names a Fault makes it
misbehave in that way instead, which is how the client's error accounting is tested; with
`fail_every=N` every Nth completion call answers 503 whatever its prompt (a known share of
failures, for bench's --max-failure-rate).

Run it alone with `python -m pdserve.bench.stub` (prints READY URL), or in a thread of the
calling process with StubServer (loopback only, port chosen by the OS).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from enum import Enum
from typing import Any

from aiohttp import web

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
STALL_S = 5.0
# aiohttp's default listen backlog (128) drops the SYNs of a burst of thousands of connects,
# and each dropped one costs the client a 1 s retransmit: the stub would measure the kernel.
BACKLOG = 4096


class Fault(str, Enum):
    HTTP_503 = "fault:http503"  # an OpenAI error body with status 503
    ERROR_EVENT = "fault:error-event"  # one token, then finish_reason error and an error event
    TRUNCATED = "fault:truncated"  # one token, then the stream ends without finish or [DONE]
    BAD_JSON = "fault:bad-json"  # a data line that is not JSON
    STALL = "fault:stall"  # answers only after STALL_S (for client timeouts)


class Style(str, Enum):
    """Correct streams that differ in where the finishing chunk's content goes."""

    TOKEN_AT_FINISH = "style:token-at-finish"  # the last token rides on the finish chunk
    FLUSH_AT_FINISH = "style:flush-at-finish"  # the finish chunk only flushes held-back text


_FAULTS = {f.value for f in Fault}
_STYLES = {s.value for s in Style}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(text: str, finish: str | None) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": "cmpl-stub", "object": "text_completion", "model": "stub", "choices": [choice]}


def stream_bytes(tokens: int, prompt_tokens: int = 8, style: Style | None = None) -> bytes:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens}
    usage["total_tokens"] = prompt_tokens + tokens
    parts = [_sse(_chunk(" tok", None)) for _ in range(tokens)]
    if style is Style.TOKEN_AT_FINISH:
        parts[-1] = _sse(_chunk(" tok", "length"))
    else:
        flushed = "\ufffd" if style is Style.FLUSH_AT_FINISH else ""
        parts.append(_sse(_chunk(flushed, "length")))
    parts.append(_sse({"id": "cmpl-stub", "choices": [], "usage": usage}))
    return b"".join(parts) + b"data: [DONE]\n\n"


def _fault_bytes(fault: Fault) -> bytes:
    if fault is Fault.ERROR_EVENT:
        error = {"error": {"message": "stub failure", "type": "server_error"}}
        return _sse(_chunk(" tok", None)) + _sse(_chunk("", "error")) + _sse(error)
    if fault is Fault.TRUNCATED:
        return _sse(_chunk(" tok", None))
    return b"data: {not json\n\n" + b"data: [DONE]\n\n"  # BAD_JSON


class StubServer:
    """The stub in a background thread with its own event loop; a context manager."""

    def __init__(self, tokens: int = 8, fail_every: int | None = None) -> None:
        if fail_every is not None and fail_every < 1:
            raise ValueError(f"fail_every must be >= 1, got {fail_every}")
        self.tokens = tokens
        self.fail_every = fail_every
        self.calls = 0  # completion calls answered so far (on the stub's event loop only)
        self.body = stream_bytes(tokens)
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-stub", daemon=True)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        prompt = (await request.json()).get("prompt")
        fault = Fault(prompt) if isinstance(prompt, str) and prompt in _FAULTS else None
        self.calls += 1
        if self.fail_every is not None and self.calls % self.fail_every == 0:
            fault = Fault.HTTP_503
        if fault is Fault.HTTP_503:
            return web.json_response({"error": {"message": "stub overloaded"}}, status=503)
        if fault is Fault.STALL:
            await asyncio.sleep(STALL_S)
            fault = None
        body = self.body if fault is None else _fault_bytes(fault)
        if isinstance(prompt, str) and prompt in _STYLES:
            body = stream_bytes(self.tokens, style=Style(prompt))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(body)
        await resp.write_eof()
        return resp

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        # A short shutdown: a stalled handler must not hold up the caller's teardown.
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=0.5)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0, backlog=BACKLOG)
        self._loop.run_until_complete(site.start())
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        # Handlers still running past the shutdown timeout (a stall) are cancelled, not leaked.
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    def __enter__(self) -> StubServer:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise RuntimeError(f"the stub server did not start within {START_TIMEOUT_S}s")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(STOP_TIMEOUT_S)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tokens", type=int, default=8, help="tokens per streamed answer")
    p.add_argument("--fail-every", type=int, default=None, help="every Nth call answers 503")
    args = p.parse_args()
    stub = StubServer(args.tokens, args.fail_every)

    async def serve() -> None:
        runner = web.AppRunner(stub.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", args.port, backlog=BACKLOG)
        await site.start()
        print(f"READY http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()  # until the parent kills us

    asyncio.run(serve())


if __name__ == "__main__":
    main()
