"""`text_offset`s cost a detokeniser per choice, walked token by token (frontend/format.py): only
a completion with logprobs pays for them, and a stream builds them once per choice.

Counted through a real aiohttp app in this process over the fake scoring engine: the
tokenizer counts the incremental detokenisers it hands out. Each choice's text needs one
(frontend/generation.py); offsets are one more per choice, and only where they are shown.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pdserve.frontend.api import OpenAIApi
from tests.frontend.fakes import Tokenizer, app_with
from tests.frontend.test_streamed_echo import MAX_LEN, ScoringEngine

N = 2  # choices a call


class CountingTokenizer(Tokenizer):
    def __init__(self) -> None:
        self.detokenizers = 0

    def incremental(self, skip_special_tokens: bool = True) -> Any:
        self.detokenizers += 1
        return super().incremental(skip_special_tokens)


def detokenizers_for(path: str, body: dict[str, Any]) -> int:
    tok = CountingTokenizer()
    api = OpenAIApi(ScoringEngine(), tok, "m", MAX_LEN, 5.0)

    async def go() -> None:
        async with TestClient(TestServer(app_with(api))) as client:
            r = await client.post(path, json={**body, "n": N, "max_tokens": 2})
            await r.read()
            assert r.status == 200

    asyncio.run(go())
    return tok.detokenizers


COMPLETION = ("/v1/completions", {"prompt": [5, 3, 9]})
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}]})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "endpoint, extra",
    [
        (COMPLETION, {}),
        (COMPLETION, {"echo": True}),
        (CHAT, {}),
        (CHAT, {"logprobs": True, "top_logprobs": 1}),  # chat shows no offsets
    ],
)
def test_no_offsets_where_none_are_shown(endpoint, extra, stream) -> None:
    path, body = endpoint
    assert detokenizers_for(path, {**body, **extra, "stream": stream}) == N  # the texts only


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_with_logprobs_walks_its_offsets_once_per_choice(stream) -> None:
    path, body = COMPLETION
    assert detokenizers_for(path, {**body, "logprobs": 1, "stream": stream}) == 2 * N
