"""The OpenAI-compatible HTTP API (aiohttp): completions, chat completions, models.

Text lives here (tokenize, chat template, detokenize, stop strings); the backend sees token
ids only. Errors are OpenAI-shaped bodies with a 4xx/5xx status; a failure after a stream
has begun ends the stream with an error finish_reason and an error event, never a fake stop.

Tokenizing a prompt and rendering a chat template run on a small thread pool, never on the
event loop: a 40 MB prompt once froze a router for 34 s. (That helps only as far as the
tokenizer releases the GIL while it works.) Before that, a text is bounded by its cheapest
measure (LESSONS #19): one longer than `max_prompt_chars` (the context times the most
characters one token can stand for) cannot fit and is refused untokenized. The tokenizing
has a deadline (TOKENIZE_TIMEOUT_S), and a client that leaves takes its queued tokenizing
with it; the threads are daemons, so a server told to stop does not wait at exit for a
tokenization in flight (frontend/tokenizer_pool.py). Detokenizing streamed tokens stays on
the loop: about 5 us a token. Bodies are read by server/body.py (`read_body`: a time limit, a
size limit, and compressed bodies inflated with a bound).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from aiohttp import web

from pdserve.frontend.format import Formatter, sse
from pdserve.frontend.generation import Backend, Generation
from pdserve.frontend.protocol import (
    MAX_CHOICES,
    ApiError,
    GenerationSpec,
    bad,
    parse_chat,
    parse_completion,
    parse_json_body,
)
from pdserve.frontend.tokenizer_pool import TokenizerPool
from pdserve.frontend.tools import check_template
from pdserve.protocol.outputs import is_deadline_error
from pdserve.protocol.sampling import InvalidParams
from pdserve.server.body import MAX_BODY_BYTES, read_body
from pdserve.server.connection import on_disconnect

log = logging.getLogger(__name__)

TOKENIZER_THREADS = 4  # prompts tokenized at once, per front end; the rest wait their turn
TOKENIZE_TIMEOUT_S = 30.0  # one call's tokenizing (its queue wait included)
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
        max_prompt_chars: int | None = None,
    ) -> None:
        """`max_prompt_chars`: the longest text prompt (or rendered chat) tokenized; None, no
        bound (tests' fake tokenizers). Servers pass `prompt_char_bound(...)`."""
        self.backend = backend
        self.tok = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.default_timeout_s = default_timeout_s
        self.max_prompt_chars = max_prompt_chars
        self.max_body_bytes = body_bound(max_model_len)  # the app's client_max_size
        self.created = int(time.time())
        self._tokenize_pool = TokenizerPool(TOKENIZER_THREADS)
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
                for p in spec.prompts:
                    if isinstance(p, str):
                        self._check_chars(len(p), "prompt")
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
            self._check_chars(text_chars(spec.messages), "messages")  # a template adds to it
            prompt = await self._off_loop(self._chat_prompt, spec)
            return await self._serve(request, spec, [prompt])
        except ApiError as e:
            return error_response(e)

    def _check_chars(self, chars: int, param: str) -> None:
        """400 for a text too long for the context whatever its tokens (before tokenizing)."""
        limit = self.max_prompt_chars
        if limit is not None and chars > limit:
            raise ApiError(
                400,
                f"the {param} is {chars} characters: more than this model's context of "
                f"{self.max_model_len} tokens can hold (at most {limit} characters)",
                param=param,
                code="context_length_exceeded",
            )

    # -- on the tokenizer threads ---------------------------------------------------------
    async def _off_loop(self, fn: Callable[[A], T], arg: A) -> T:
        """`fn(arg)` on a tokenizer thread, within TOKENIZE_TIMEOUT_S (413 past it). If the
        handler is cancelled first (its client left), a call still queued never runs."""
        try:
            async with asyncio.timeout(TOKENIZE_TIMEOUT_S):
                return await self._tokenize_pool.run(fn, arg)
        except TimeoutError:
            raise ApiError(
                413,
                f"the prompt was not tokenized within {TOKENIZE_TIMEOUT_S:.0f}s: send a "
                "shorter one",
                code="prompt_too_large",
            ) from None

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
        self._check_chars(len(text), "messages")
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
        self._tokenize_pool.close()

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
        fmt = Formatter(self.tok, self.model_name, spec, gen, prompts)
        handler = asyncio.current_task()

        def client_lost() -> None:
            # Not left to aiohttp's cancellation of the handler alone: Python 3.11's
            # asyncio.wait_for can swallow a cancel that lands as its awaitable completes.
            gen.close()
            if handler is not None:
                handler.cancel()

        gen.start()
        self._live.add(gen)
        unwatch = on_disconnect(request, client_lost)
        try:
            if spec.stream:
                return await self._stream(request, gen, fmt)
            async for d in gen.deltas():
                fmt.accumulate(d)
        except (asyncio.CancelledError, ConnectionError):
            # The client disconnected (before the response started or after) or a write to
            # it failed. The `finally` aborts what still runs; one line, no traceback.
            if _client_gone(request):
                gen.close()
                log.info(
                    "%s %s: the client disconnected after %d tokens; %d unfinished choices aborted",
                    request.path,
                    fmt.id,
                    gen.completion_tokens,
                    gen.aborted,
                )
            raise
        finally:
            # Every window of the answer's life ends here, whatever ended it (LESSONS #17).
            unwatch()
            self._live.discard(gen)
            gen.close()
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


BODY_BYTES_PER_TOKEN = 16  # a token as JSON: an id and its comma, or ~4 characters of UTF-8
MIN_BODY_BYTES = 4 * 2**20


def body_bound(max_model_len: int) -> int:
    """The largest request body the front end reads (client_max_size; larger is 413 before it
    is all read): what the most prompts a body may carry (MAX_CHOICES) could use of the
    context, at BODY_BYTES_PER_TOKEN, within [MIN_BODY_BYTES, MAX_BODY_BYTES]. A body larger
    than the model can take costs no more than this much memory (LESSONS #19)."""
    useful = MAX_CHOICES * max_model_len * BODY_BYTES_PER_TOKEN
    return min(MAX_BODY_BYTES, max(MIN_BODY_BYTES, useful))


def prompt_char_bound(max_token_chars: int, max_model_len: int) -> int:
    """The longest text that could still fit a context of `max_model_len` tokens when no
    token stands for more than `max_token_chars` characters (Tokenizer.max_token_chars)."""
    return max(max_token_chars, 1) * max_model_len


def text_chars(value: Any) -> int:
    """Characters in every string value of a parsed JSON value: the messages' contents, which
    a chat template renders (plus its own text)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(text_chars(v) for v in value)
    return 0


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
