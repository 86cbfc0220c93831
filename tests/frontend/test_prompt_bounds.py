"""A prompt against the context (frontend/prompts.py): past it, a 400 in vLLM's words that
clients map to their context-window error; truncate_prompt_tokens keeps the last k tokens
(vLLM's semantics, -1 the context's length), the BOS a text's tokenizing put first staying.

Real aiohttp apps in this process, the tiny model's real tokenizer (its encode puts a BOS
first), a fake engine that keeps the prompt it was sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve.frontend.api import OpenAIApi
from pdserve.model.tokenizer import Tokenizer
from tests.frontend.fakes import Scripted, call

MAX_LEN = 32
# What litellm's exception mapping looks for to raise ContextWindowExceededError (its
# exception_mapping_utils), and OpenAI's code for the same error.
LITELLM_CONTEXT_WORDS = "This model's maximum context length is"
LONG = "one two three four five six seven eight nine ten " * 4  # > MAX_LEN tokens


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


def send(tok: Tokenizer, path: str, body: dict[str, Any], chars: int | None = None) -> Any:
    """(status, answer, the prompts the engine got)."""
    engine = Scripted(4096, MAX_LEN)
    api = OpenAIApi(engine, tok, "m", MAX_LEN, 5.0, max_prompt_chars=chars)
    try:
        status, answer = call(api, "POST", path, body)
    finally:
        api.close()
    return status, answer, engine.prompts


@pytest.mark.parametrize(
    "path,body,param,where",
    [
        ("/v1/completions", {"prompt": LONG}, "prompt", "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_LEN}, "max_tokens", "prompt"),
        ("/v1/completions", {"prompt": list(range(3, 3 + MAX_LEN))}, "prompt", "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": LONG}]},
            "prompt",
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": MAX_LEN},
            "max_tokens",
            "messages",
        ),
    ],
)
def test_past_the_context_is_vllms_400_with_a_code(tok, path, body, param, where):
    status, answer, sent = send(tok, path, body)
    assert status == 400 and sent == []
    err = answer["error"]
    assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"
    assert err["message"].startswith(f"{LITELLM_CONTEXT_WORDS} {MAX_LEN} tokens. However, you ")
    assert f"in the {where}, " in err["message"] and "in the completion" in err["message"]
    assert err["param"] == param


def test_a_text_refused_untokenized_says_so_in_the_same_words(tok):
    status, answer, _ = send(tok, "/v1/completions", {"prompt": LONG}, chars=50)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert answer["error"]["message"].startswith(f"{LITELLM_CONTEXT_WORDS} {MAX_LEN} tokens.")


def test_truncate_prompt_tokens_keeps_the_last_k(tok):
    ids = tok.encode(LONG)
    assert ids[0] == tok.bos_token_id and len(ids) > MAX_LEN
    status, answer, sent = send(
        tok, "/v1/completions", {"prompt": LONG, "truncate_prompt_tokens": 10, "max_tokens": 1}
    )
    assert status == 200, answer
    assert sent == [[ids[0], *ids[-9:]]]  # the BOS the tokenizer put first, then the last 9
    assert answer["usage"]["prompt_tokens"] == 10
    given = list(range(3, 3 + 2 * MAX_LEN))  # token ids: the last k, nothing kept first
    body = {"prompt": given, "truncate_prompt_tokens": 5, "max_tokens": 1}
    assert send(tok, "/v1/completions", body)[2] == [given[-5:]]
    messages = [{"role": "user", "content": LONG}]
    chat = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    body = {"messages": messages, "truncate_prompt_tokens": 12, "max_tokens": 1}
    assert send(tok, "/v1/chat/completions", body)[2] == [chat[-12:]]


def test_truncate_prompt_tokens_is_not_bounded_by_characters(tok):
    body = {"prompt": LONG, "truncate_prompt_tokens": 10, "max_tokens": 1}
    status, answer, sent = send(tok, "/v1/completions", body, chars=50)
    assert status == 200 and len(sent[0]) == 10, answer


def test_truncate_prompt_tokens_minus_one_is_the_context(tok):
    given = list(range(3, 3 + 2 * MAX_LEN))
    body = {"prompt": given, "truncate_prompt_tokens": -1, "max_tokens": 0, "echo": True}
    status, answer, sent = send(tok, "/v1/completions", body)
    # the last MAX_LEN tokens, which leave no room: vLLM's context error, as vLLM would say
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert f"{MAX_LEN} in the prompt" in answer["error"]["message"]


@pytest.mark.parametrize("k", [0, -2, MAX_LEN + 1, "5", 1.5, True])
def test_a_bad_truncate_prompt_tokens_is_a_400_naming_it(tok, k):
    status, answer, sent = send(
        tok, "/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": k}
    )
    assert status == 400 and sent == []
    assert answer["error"]["param"] == "truncate_prompt_tokens"
