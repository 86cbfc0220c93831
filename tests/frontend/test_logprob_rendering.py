"""How generated text and logprobs are shown (frontend/format.py, frontend/textstream.py), as
vLLM shows them: a token is its decoded text in `tokens` and in the `top_logprobs` keys alike
(the token there always among its alternatives, with its own logprob), or "token_id:N" with
return_tokens_as_token_ids; a choice that ends inside a UTF-8 character does not show the
part; prompt_logprobs per prompt token.

Real aiohttp apps in this process, the tiny model's real tokenizer (byte-level: "界" is three
tokens, each a part of the character), a fake engine that emits what each test scripts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve.frontend.api import OpenAIApi
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.outputs import TokenLogprob
from tests.frontend.fakes import Scripted, call, stream

MAX_LEN = 512
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


def answer(tok: Tokenizer, script: Any, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """(the whole answer, the stream's chunks) for `body`, the engine answering `script`."""
    api = OpenAIApi(Scripted(4096, MAX_LEN, script), tok, "m", MAX_LEN, 5.0)
    try:
        status, whole = call(api, "POST", path, body)
        assert status == 200, whole
        chunks = stream(api, path, body) if "prompt_logprobs" not in body else []
    finally:
        api.close()
    return whole, chunks


def emits(ids: list[int], alternatives: tuple[tuple[int, float], ...] = ()) -> Any:
    """A script: `ids`, one output each, each scored with `alternatives`; then the end."""

    def script(prompt: list[int], params: Any) -> list[tuple[Any, ...]]:
        outs: list[tuple[Any, ...]] = []
        for k, t in enumerate(ids):
            lp = (TokenLogprob(t, -1.0 - k, alternatives),) if params.logprobs is not None else ()
            outs.append(((t,), lp, "length" if k == len(ids) - 1 else None, None, len(prompt)))
        return outs

    return script


def test_a_partial_character_token_shows_alike_in_tokens_and_its_alternatives(tok):
    part, other = tok.encode("界", add_special_tokens=False)[:2]
    a = tok.encode("a", add_special_tokens=False)[0]
    script = emits([part], ((a, -0.5), (other, -0.7)))
    whole, _ = answer(tok, script, "/v1/completions", {"prompt": "x", "logprobs": 2})
    lp = whole["choices"][0]["logprobs"]
    assert lp["tokens"] == ["\ufffd"]  # vLLM's rendering: the decoded text
    top = lp["top_logprobs"][0]
    assert top["\ufffd"] == lp["token_logprobs"][0] == -1.0  # the token there, under its key
    assert top["a"] == -0.5
    whole, _ = answer(tok, script, "/v1/chat/completions", {**CHAT, "logprobs": True})
    [entry] = whole["choices"][0]["logprobs"]["content"]
    assert entry["token"] == "\ufffd" and entry["bytes"] == list(tok.token_bytes(part))
    assert entry["top_logprobs"] == []  # top_logprobs 0: none (chat's are exactly the N best)


@pytest.mark.parametrize(
    "path,body", [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", CHAT)]
)
def test_a_choice_that_ends_inside_a_character_does_not_show_its_part(tok, path, body):
    ok, cut = tok.encode("ok", add_special_tokens=False), tok.encode("界", add_special_tokens=False)
    whole, chunks = answer(tok, emits(ok + cut[:2]), path, {**body, "max_tokens": 8})
    c = whole["choices"][0]
    text = c["text"] if "text" in c else c["message"]["content"]
    assert text == "ok"  # not "ok\ufffd": vLLM holds the part back and never shows it
    streamed = "".join(
        ch["choices"][0].get("text", "") or ch["choices"][0].get("delta", {}).get("content", "")
        for ch in chunks
    )
    assert streamed == "ok"
    whole, _ = answer(tok, emits(ok + cut), path, {**body, "max_tokens": 8})
    c = whole["choices"][0]
    assert (c["text"] if "text" in c else c["message"]["content"]) == "ok界"  # complete: shown


def test_return_tokens_as_token_ids(tok):
    a, b = tok.encode("ab", add_special_tokens=False)[0], 7
    script = emits([a], ((b, -0.5),))
    body = {"prompt": "x", "logprobs": 1, "return_tokens_as_token_ids": True}
    whole, chunks = answer(tok, script, "/v1/completions", body)
    lp = whole["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{a}"]
    assert lp["top_logprobs"] == [{f"token_id:{b}": -0.5, f"token_id:{a}": -1.0}]
    assert chunks[0]["choices"][0]["logprobs"]["tokens"] == [f"token_id:{a}"]
    body = {**CHAT, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}
    whole, _ = answer(tok, script, "/v1/chat/completions", body)
    [entry] = whole["choices"][0]["logprobs"]["content"]
    assert (
        entry["token"] == f"token_id:{a}" and entry["top_logprobs"][0]["token"] == f"token_id:{b}"
    )
    assert whole["choices"][0]["message"]["content"] == tok.decode([a])  # the text stays text


def scored_prompt(prompt: list[int], params: Any) -> list[tuple[Any, ...]]:
    """Scores each prompt token after the first: itself at -1.5, the best two 5 and 6."""
    n = params.prompt_logprobs
    scores = tuple(TokenLogprob(t, -1.5, ((5, -0.25), (6, -0.5))[:n]) for t in prompt[1:])
    return [((9,), (), "length", None, len(prompt), scores)]


def test_prompt_logprobs_in_vllms_shape(tok):
    body = {"prompt": [3, 5, 8], "prompt_logprobs": 1, "max_tokens": 1}
    whole, _ = answer(tok, scored_prompt, "/v1/completions", body)
    d = lambda t: tok.decode([t], skip_special_tokens=False)  # noqa: E731
    assert whole["choices"][0]["prompt_logprobs"] == [
        None,
        {"5": {"logprob": -1.5, "rank": 1, "decoded_token": d(5)}},  # the best itself: rank 1
        {
            "8": {"logprob": -1.5, "rank": None, "decoded_token": d(8)},  # outside the best
            "5": {"logprob": -0.25, "rank": 1, "decoded_token": d(5)},
        },
    ]
    whole, _ = answer(tok, scored_prompt, "/v1/chat/completions", {**CHAT, "prompt_logprobs": 0})
    shown = whole["prompt_logprobs"]  # chat: the response's, the prompt being one
    ids = tok.encode(tok.apply_chat_template(CHAT["messages"]), add_special_tokens=False)
    assert shown[0] is None and len(shown) == len(ids)
    assert all(len(p) == 1 and next(iter(p.values()))["logprob"] == -1.5 for p in shown[1:])


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}),
        ("/v1/chat/completions", {**CHAT, "prompt_logprobs": "1"}),
        ("/v1/completions", {"prompt": "x", "return_tokens_as_token_ids": 1}),
    ],
)
def test_bad_logprob_options_are_a_400_naming_them(tok, path, body):
    api = OpenAIApi(Scripted(4096, MAX_LEN), tok, "m", MAX_LEN, 5.0)
    try:
        status, err = call(api, "POST", path, body)
    finally:
        api.close()
    named = [k for k in body if k in ("prompt_logprobs", "return_tokens_as_token_ids")][0]
    assert status == 400 and err["error"]["param"] == named, err
