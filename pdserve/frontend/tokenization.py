"""vLLM's /tokenize and /detokenize, in its request and response shapes.

* POST /tokenize {model?, prompt, add_special_tokens? (true), return_token_strs?} or
  {model?, messages, add_generation_prompt?, continue_final_message?, add_special_tokens?
  (false), chat_template?, chat_template_kwargs?, tools?, return_token_strs?} ->
  {count, max_model_len, tokens, token_strs}. A chat renders as /v1/chat/completions renders
  it (frontend/chat.py, frontend/prompts.py); `tools` are shown to the template, as chat's
  tool_choice "none" shows them. `token_strs` (null unless asked): the vocabulary's pieces.
  The text may be longer than the context: counting it is the point.
* POST /detokenize {model?, tokens} -> {prompt}: special tokens kept, as vLLM decodes.

Served where the tokenizer is (a co-located server, the router); the same auth as /v1/*.

A text /tokenize counts is bounded only by the body's size (64 MiB: millions of tokens), so
its answer is built where its tokens were, on a tokenizer thread (frontend/prompts.py
`off_loop`), never on the event loop: the pieces, and the JSON, in chunks of ANSWER_CHUNK
items (one json.dumps call holds the GIL throughout; between chunks the loop gets its turn).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from pdserve.frontend.chat import parse_chat_prompt
from pdserve.frontend.fields import check_unknown
from pdserve.frontend.prompts import Prompts
from pdserve.frontend.tools import parse_tools
from pdserve.protocol.sampling import InvalidParams, is_int, show
from pdserve.server.api_error import ApiError, bad
from pdserve.server.body import read_body
from pdserve.server.json_body import parse_json_body

TOKEN_ID_BOUND = 2**31  # ids a tokenizer could hold; the model's own bound is not checked
ANSWER_CHUNK = 16_384  # list items JSON-encoded per call (~2 ms of ids)


class TokenizationApi:
    def __init__(
        self,
        prompts: Prompts,
        tokenizer: Any,
        max_model_len: int,
        check_model: Callable[[str], None],
    ) -> None:
        """`check_model(name)`: raises the 404 for a model this server does not serve."""
        self.prompts = prompts
        self.tok = tokenizer
        self.max_model_len = max_model_len
        self.check_model = check_model

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize)]

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request, "tokenize")
            self.check_model(_model(body))
            prompts = self.prompts
            has_prompt, has_messages = body.get("prompt") is not None, "messages" in body
            if has_prompt == has_messages:
                raise bad("send either 'prompt' (a string) or 'messages'", "prompt")
            if has_messages:
                chat = parse_chat_prompt(body, _tools(body))
                special = _flag(body, "add_special_tokens", False)
                ids = await prompts.chat_ids(chat, bounded=False, add_special_tokens=special)
            else:
                text = body["prompt"]
                if not isinstance(text, str):
                    raise bad("'prompt' must be a string", "prompt")
                ids = await prompts.text_ids(text, _flag(body, "add_special_tokens", True))
            with_strs = _flag(body, "return_token_strs", False)
            answer = await prompts.off_loop(self._answer, (ids, with_strs))
            return web.Response(body=answer, content_type="application/json", charset="utf-8")
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)

    def _answer(self, ids_and_strs: tuple[list[int], bool]) -> bytes:
        """/tokenize's JSON body (on a tokenizer thread): as json.dumps writes it."""
        ids, with_strs = ids_and_strs
        strs = json_list([self.tok.token_piece(t) for t in ids]) if with_strs else "null"
        return (
            f'{{"count": {len(ids)}, "max_model_len": {self.max_model_len}, '
            f'"tokens": {json_list(ids)}, "token_strs": {strs}}}'
        ).encode()

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request, "detokenize")
            self.check_model(_model(body))
            tokens = body.get("tokens")
            if not (
                isinstance(tokens, list)
                and all(is_int(t) and 0 <= t < TOKEN_ID_BOUND for t in tokens)
            ):
                raise bad(
                    f"'tokens' must be a list of token ids (integers in [0, {TOKEN_ID_BOUND}))",
                    "tokens",
                )
            return web.json_response({"prompt": await self.prompts.decode(tokens)})
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)


def json_list(items: Sequence[Any]) -> str:
    """json.dumps(items), ANSWER_CHUNK items a call."""
    parts = (
        json.dumps(items[i : i + ANSWER_CHUNK])[1:-1] for i in range(0, len(items), ANSWER_CHUNK)
    )
    return "[" + ", ".join(parts) + "]"


async def _body(request: web.Request, kind: str) -> dict[str, Any]:
    """The request's JSON object (api.read_json's checks), its fields checked for `kind`."""
    body = parse_json_body(await read_body(request), request.charset)
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    try:
        check_unknown(body, kind)
    except InvalidParams as e:
        raise bad(str(e), e.param) from e
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"'model' must be a string, got {type(model).__name__}", "model")
    return model or ""


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false, got {show(v)}", name)
    return v


def _tools(body: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """The tools to show the template: chat's rule for tool_choice "none" (nothing here asks
    for calls)."""
    if body.get("tools") is None:
        return ()
    try:
        return parse_tools({"tools": body["tools"], "tool_choice": "none"}).tools
    except InvalidParams as e:
        raise bad(str(e), e.param) from e
