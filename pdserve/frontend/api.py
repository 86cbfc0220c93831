"""The OpenAI-compatible HTTP API (aiohttp): completions, chat completions, models; vLLM's
/tokenize, /detokenize (frontend/tokenization.py) and /version.

Text lives here (tokenize, chat template, detokenize, stop strings); the backend sees token
ids only. Errors are OpenAI-shaped bodies with a 4xx/5xx status; a failure after a stream
has begun ends the stream with an error finish_reason and an error event, never a fake stop.

A prompt's ids, its bounds and its truncation are frontend/prompts.py's (tokenizing off the
event loop, LESSONS #19). An output constraint is parsed with the body and built (compiled)
off the loop too, just before the request is served (frontend/constraint_threads.py).
Detokenizing streamed tokens stays on the loop: about 5 us a token.
Bodies are read by server/body.py (`read_body`: a time limit, a size limit, and compressed
bodies inflated with a bound).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import logging
import time
from typing import Any

from aiohttp import web

from pdserve.config import FrontendConfig
from pdserve.frontend.chat import ChatPrompt
from pdserve.frontend.constraint_threads import ConstraintThreads
from pdserve.frontend.format import Formatter, sse
from pdserve.frontend.generation import Backend, Generation
from pdserve.frontend.prompts import Prompts
from pdserve.frontend.prompts import prompt_char_bound as prompt_char_bound  # re-exported
from pdserve.frontend.prompts import text_chars as text_chars  # re-exported
from pdserve.frontend.protocol import (
    MAX_CHOICES,
    ApiError,
    GenerationSpec,
    bad,
    parse_chat,
    parse_completion,
    parse_json_body,
)
from pdserve.frontend.tokenization import TokenizationApi
from pdserve.frontend.tool_answer import ToolAnswer
from pdserve.frontend.tool_use import ToolCalling, ToolUse
from pdserve.protocol.outputs import is_deadline_error
from pdserve.protocol.sampling import InvalidParams
from pdserve.server.body import MAX_BODY_BYTES, read_body
from pdserve.server.connection import on_disconnect

log = logging.getLogger(__name__)


def _version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


VERSION = _version()


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
        frontend: FrontendConfig | None = None,
    ) -> None:
        """`max_prompt_chars`: the longest text prompt (or rendered chat) tokenized; None, no
        bound (tests' fake tokenizers). Servers pass `prompt_char_bound(...)`. `frontend`:
        the tool-call parser, whether a request's own chat template is rendered; ValueError
        for an unknown parser (default: FrontendConfig())."""
        frontend = frontend or FrontendConfig()
        self.backend = backend
        self.tok = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.default_timeout_s = default_timeout_s
        self.max_body_bytes = body_bound(max_model_len)  # the app's client_max_size
        self.created = int(time.time())
        self.prompts = Prompts(
            tokenizer, max_model_len, max_prompt_chars, frontend.trust_request_chat_template
        )
        self.tool_calling = ToolCalling(tokenizer, frontend.tool_call_parser)
        self.constraints = ConstraintThreads()
        self.tokenization = TokenizationApi(
            self.prompts, tokenizer, max_model_len, self.check_model
        )
        self._live: set[Generation] = set()  # generations whose answer is not over

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model_id:.+}", self.model),
            web.get("/version", self.version),
            *self.tokenization.routes(),
        ]

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "pdserve",
            "max_model_len": self.max_model_len,
        }

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

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
            self.check_model(spec.model)
            keep = self.prompts.kept_tokens(spec.truncate_prompt_tokens)
            prompts = await self.prompts.completion_ids(spec.prompts, keep)
            return await self._serve(request, spec, prompts)
        except ApiError as e:
            return error_response(e)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            spec = parse_chat(await read_json(request))
            self.check_model(spec.model)
            keep = self.prompts.kept_tokens(spec.truncate_prompt_tokens)
            chat = ChatPrompt(spec.messages, spec.chat_kwargs, spec.chat_template, spec.echo_text)
            prompt = await self.prompts.chat_ids(chat, keep)
            try:  # frontend/tool_use.py: the parser, and calls forced by a grammar
                tools, constraint = self.tool_calling.plan(
                    spec.tools, spec.chat_template, spec.constraint
                )
            except InvalidParams as e:
                raise bad(str(e), e.param) from e
            spec = dataclasses.replace(spec, constraint=constraint)
            return await self._serve(request, spec, [prompt], tools)
        except ApiError as e:
            return error_response(e)

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
        """Stop the tokenizer and constraint threads (what is running finishes; what waits is
        dropped) and the template jail's helpers."""
        self.prompts.close()
        self.constraints.close()

    def check_model(self, model: str) -> None:
        """404 for a model this server does not serve ("" asks for no model in particular)."""
        if model and model != self.model_name:
            raise _no_such_model(model, self.model_name)

    async def _serve(
        self,
        request: web.Request,
        spec: GenerationSpec,
        prompts: list[list[int]],
        tools: ToolUse | None = None,
    ) -> web.StreamResponse:
        params = spec.params
        try:
            if spec.constraint is not None:  # compiled off the loop: one await, here only
                params = params.replace(constraint=await self.constraints.build(spec.constraint))
            if not spec.max_tokens_given and spec.kind == "chat":
                # Chat without max_tokens: generate until EOS or the end of the context.
                room = self.max_model_len - max(len(p) for p in prompts)
                params = params.replace(max_tokens=max(room, 1))  # min_tokens may not fit
            for p in prompts:
                self.prompts.check_context(len(p), params.max_tokens, spec.kind)
                self.backend.validate(p, params)
        except InvalidParams as e:
            raise bad(str(e), e.param) from e
        keep = tools.keep if tools is not None else frozenset()  # the parser's special tokens
        gen = Generation(
            self.backend,
            prompts,
            spec.n,
            params,
            lambda: (
                self.tok.incremental(spec.skip_special_tokens, keep)
                if keep
                else self.tok.incremental(spec.skip_special_tokens)
            ),
            spec.stop,
            spec.include_stop_str,
            spec.timeout_s or self.default_timeout_s,
        )
        answer = ToolAnswer(tools) if tools is not None else None
        fmt = Formatter(self.tok, self.model_name, spec, gen, prompts, answer)
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
