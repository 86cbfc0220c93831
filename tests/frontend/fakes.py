"""A tokenizer whose token i is the letter chr(97 + i % 26), and an app around an OpenAIApi."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from aiohttp import web

from pdserve.frontend.api import OpenAIApi
from pdserve.server.errors import error_middleware


class Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [(ord(c) - 97) % 26 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self.decode([token_id]).encode()

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        return "".join(m["content"] for m in messages)

    def incremental(self, skip_special_tokens: bool = True) -> Any:
        return SimpleNamespace(push=lambda t: chr(97 + t % 26), flush=lambda: "")


def app_with(api: OpenAIApi) -> web.Application:
    app = web.Application(middlewares=[error_middleware()])
    app.add_routes(api.routes())
    return app
