"""The OpenAI-compatible HTTP API (aiohttp): completions, chat completions, models.

Text lives here (tokenize, chat template, detokenize, stop strings); the backend sees token
ids only. Errors are OpenAI-shaped bodies with a 4xx/5xx status; a failure after a stream
has begun ends the stream with an error finish_reason and an error event, never a fake stop.

Tokenizing a prompt and rendering a chat template run on a small thread pool, never on the
event loop: a 40 MB prompt once froze a router for 34 s. (That helps only as far as the
tokenizer releases the GIL while it works.) Detokenizing streamed tokens stays on the loop:
about 5 us a token. A request body must arrive within BODY_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web

from pdserve.frontend.format import Formatter, sse
from pdserve.frontend.generation import Backend, Generation
from pdserve.frontend.protocol import (
    ApiError,
    GenerationSpec,
    bad,
    parse_chat,
    parse_completion,
    parse_json_body,
)
from pdserve.frontend.tools import check_template
from pdserve.protocol.outputs import is_deadline_error
from pdserve.protocol.sampling import InvalidParams
from pdserve.runtime.timing import BODY_TIMEOUT_S

log = logging.getLogger(__name__)

TOKENIZER_THREADS = 4  # prompts tokenized at once, per front end; the rest wait their turn
T = TypeVar("T")
A = TypeVar("A")


def error_response(e: ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


def failure(error: str | None) -> ApiError:
    """How a generation that ended in error is reported: 408 when its own timeout ended it (the
    client asked for more than the time it gave), else 500."""
    if is_deadline_error(error):
        return ApiError(
            408, f"{error} (the request's timeout)", type_="timeout_error", code="timeout"
        )
    return ApiError(500, error or "generation failed", type_="server_error")


class OpenAIApi:
    def __init__(
        self,
        backend: Backend,
        tokenizer: Any,
        model_name: str,
        max_model_len: int,
        default_timeout_s: float,
    ) -> None:
        self.backend = backend
        self.tok = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.default_timeout_s = default_timeout_s
        self.created = int(time.time())
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        self._live: set[Generation] = set()  # generations whose answer is not over

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model_id:.+}", self.model),
        ]

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "pdserve",
            "max_model_len": self.max_model_len,
        }

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: the one model this server serves, else 404 (as OpenAI)."""
        model_id = request.match_info["model_id"]
        if model_id != self.model_name:
            return error_response(_no_such_model(model_id, self.model_name))
        return web.json_response(self._card())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            spec = parse_completion(await read_json(request))
            self._check_model(spec)
            if any(isinstance(p, str) for p in spec.prompts):
                prompts = await self._off_loop(self._encode_prompts, spec.prompts)
            else:  # token ids already: no tokenizer, so no hop to its threads and back
                prompts = self._encode_prompts(spec.prompts)
            return await self._serve(request, spec, prompts)
        except ApiError as e:
            return error_response(e)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            spec = parse_chat(await read_json(request))
            self._check_model(spec)
            prompt = await self._off_loop(self._chat_prompt, spec)
            return await self._serve(request, spec, [prompt])
        except ApiError as e:
            return error_response(e)

    # -- on the tokenizer threads ---------------------------------------------------------
    async def _off_loop(self, fn: Callable[[A], T], arg: A) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, arg)

    def _encode_prompts(self, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
        return [self.tok.encode(p) if isinstance(p, str) else list(p) for p in prompts]

    def _chat_prompt(self, spec: GenerationSpec) -> list[int]:
        try:
            tools = spec.chat_kwargs.get("tools", ())
            check_template(spec.messages, tools, lambda: self.tok.chat_template_support)
        except InvalidParams as e:
            raise bad(str(e), e.param) from e
        except ValueError as e:  # the template does not parse
            raise bad(f"chat template: {e}", "messages") from e
        try:
            text = self.tok.apply_chat_template(list(spec.messages), **spec.chat_kwargs)
        except (ValueError, TypeError) as e:
            # The tokenizer reports whatever the template raised as ValueError; a TypeError
            # is a keyword clash at the call, which parse_chat should already have refused.
            raise bad(f"chat template: {e}", "messages") from e
        return list(self.tok.encode(text, add_special_tokens=False))

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def live(self) -> int:
        """Generations whose answer has not ended."""
        return len(self._live)

    def abort_all(self) -> int:
        """End every unfinished choice (shutdown, past the drain time); its answer ends in
        error. Returns how many choices were aborted."""
        n = 0
        for gen in list(self._live):
            for c in gen.choices:
                if c.finish_reason is None:
                    self.backend.abort(c.request_id)
                    n += 1
        return n

    def close(self) -> None:
        """Stop the tokenizer threads (what is running finishes; what waits is dropped)."""
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def _check_model(self, spec: GenerationSpec) -> None:
        if spec.model and spec.model != self.model_name:
            raise _no_such_model(spec.model, self.model_name)

    async def _serve(
        self, request: web.Request, spec: GenerationSpec, prompts: list[list[int]]
    ) -> web.StreamResponse:
        params = spec.params
        try:
            if not spec.max_tokens_given and spec.kind == "chat":
                # Chat without max_tokens: generate until EOS or the end of the context.
                room = self.max_model_len - max(len(p) for p in prompts)
                params = params.replace(max_tokens=max(room, 1))  # min_tokens may not fit
            for p in prompts:
                self.backend.validate(p, params)
        except InvalidParams as e:
            raise bad(str(e), e.param) from e
        gen = Generation(
            self.backend,
            prompts,
            spec.n,
            params,
            lambda: self.tok.incremental(spec.skip_special_tokens),
            spec.stop,
            spec.include_stop_str,
            spec.timeout_s or self.default_timeout_s,
        )
        gen.start()
        self._live.add(gen)
        fmt = Formatter(self.tok, self.model_name, spec, gen, prompts)
        try:
            if spec.stream:
                return await self._stream(request, gen, fmt)
            async for d in gen.deltas():
                fmt.accumulate(d)
        except (asyncio.CancelledError, ConnectionError):
            # aiohttp cancels the handler of a client that disconnects; a write to it fails.
            # Generation.deltas aborted what was still running. One line, no traceback.
            if _client_gone(request):
                log.info(
                    "%s %s: the client disconnected after %d tokens; its request was aborted",
                    request.path,
                    fmt.id,
                    gen.completion_tokens,
                )
            raise
        finally:
            self._live.discard(gen)
        errors = [c for c in gen.choices if c.finish_reason == "error"]
        if errors:
            return error_response(failure(errors[0].error))
        return web.json_response(fmt.full_response())

    async def _stream(
        self, request: web.Request, gen: Generation, fmt: Formatter
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        for chunk in fmt.stream_start():
            await resp.write(sse(chunk))
        async for batch in gen.batches():  # one write for whatever arrived together
            events: list[bytes] = []
            for d in batch:
                events.extend(fmt.stream_events(d))
                if d.finish_reason == "error":
                    events.append(sse(failure(d.choice.error).body()))
            await resp.write(b"".join(events))
        if fmt.spec.include_usage:
            await resp.write(sse(fmt.usage_chunk()))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def read_json(request: web.Request) -> Any:
    """The request's JSON body, through the checks every JSON endpoint shares."""
    return parse_json_body(await read_body(request), request.charset)


async def read_body(request: web.Request) -> bytes:
    """The request's body. One past the app's client_max_size raises aiohttp's 413, which the
    error middleware (pdserve.server.errors) turns into an OpenAI-style body; one that has not
    arrived within BODY_TIMEOUT_S is a 408.
    """
    try:
        return await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError as e:
        raise ApiError(
            408,
            f"the request body did not arrive within {BODY_TIMEOUT_S:.0f}s",
            type_="timeout_error",
            code="body_timeout",
        ) from e


def _no_such_model(asked: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{asked}` does not exist; this server serves `{served}`",
        param="model",
        code="model_not_found",
    )


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()
