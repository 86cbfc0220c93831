"""A streamed `echo` with `logprobs` (frontend/format.py): the prompt's text and scores come
first, as vLLM sends them, and the whole stream carries what the non-streamed answer carries;
every completions position's top list holds the token that is there (vLLM's N or N+1).

A real aiohttp app in this process over a fake engine that scores prompts."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from pdserve.frontend.api import OpenAIApi
from pdserve.protocol.outputs import RequestOutput, TokenLogprob
from pdserve.protocol.sampling import SamplingParams, validate_prompt
from tests.frontend.fakes import Tokenizer, app_with

VOCAB, MAX_LEN = 100, 64
GENERATED = (7, 8)


def score(token: int, position: int, n: int = 2) -> TokenLogprob:
    """A made-up but exact score; the n best are 3 then 4 (so `token` is among them only when
    it is one of those, with the same logprob)."""
    best = ((3, -0.5), (4, -0.75))
    return TokenLogprob(token, dict(best).get(token, -1.0 - position - token / 1000), best[:n])


class ScoringEngine:
    """Answers every request with GENERATED (two outputs), the prompt's scores on the first;
    `max_tokens: 0` gets only the scores and the end."""

    def __init__(self) -> None:
        self.params: list[SamplingParams] = []

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_ids, params, VOCAB, MAX_LEN)

    def submit(self, rid: str, prompt: list[int], params: SamplingParams, sink: Any,
               timeout_s: Any = None, **extra: Any) -> None:  # fmt: skip
        self.params.append(params)
        scored: tuple[TokenLogprob, ...] = ()
        if params.prompt_logprobs is not None:
            n = params.prompt_logprobs
            scored = tuple(score(t, i, n) for i, t in enumerate(prompt[1:], 1))
        if params.max_tokens == 0:
            sink(RequestOutput(rid, (), (), "length", None, len(prompt), scored))
            return
        gen = [score(t, 100 + i, params.logprobs or 0) for i, t in enumerate(GENERATED)]
        sink(RequestOutput(rid, GENERATED[:1], tuple(gen[:1]), None, None, len(prompt), scored))
        sink(RequestOutput(rid, GENERATED[1:], tuple(gen[1:]), "length", None, len(prompt)))

    def abort(self, rid: str) -> None:
        pass


def post(body: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    """The non-streamed answer and the streamed chunks of the same body."""
    api = OpenAIApi(ScoringEngine(), Tokenizer(), "m", MAX_LEN, 5.0)

    async def go() -> tuple[Any, list[dict[str, Any]]]:
        async with TestClient(TestServer(app_with(api))) as client:
            r = await client.post("/v1/completions", json=body)
            whole = await r.json()
            assert r.status == 200, whole
            r = await client.post("/v1/completions", json={**body, "stream": True})
            text = await r.text()
        events = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return whole, [json.loads(e) for e in events[:-1]]

    return asyncio.run(go())


def joined(chunks: list[dict[str, Any]]) -> SimpleNamespace:
    """A stream's choice 0, put back together."""
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    finish = None
    for ch in chunks:
        c = ch["choices"][0]
        text += c["text"]
        finish = c["finish_reason"] or finish
        for k, v in (c["logprobs"] or {}).items():
            lp[k] += v
    return SimpleNamespace(text=text, logprobs=lp, finish_reason=finish)


PROMPT = [5, 3, 9, 11]


def test_streamed_echo_sends_the_prompt_and_its_scores_first():
    whole, chunks = post({"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 2})
    first = chunks[0]["choices"][0]
    assert first["text"] == "fdjl"  # the fake tokenizer's text of PROMPT
    lp = first["logprobs"]
    assert lp["tokens"] == ["f", "d", "j", "l"] and lp["text_offset"] == [0, 1, 2, 3]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [score(t, i).logprob for i, t in enumerate(PROMPT[1:], 1)]
    # vLLM's top lists: the N best, then the prompt token when it is not among them
    assert lp["top_logprobs"][1] == {"d": -0.5, "e": -0.75}  # token 3 is the best: N entries
    assert lp["top_logprobs"][2] == {"d": -0.5, "e": -0.75, "j": score(9, 2).logprob}  # N+1
    stream = joined(chunks)
    assert stream.logprobs["text_offset"][4:] == [4, 5]  # the generated tokens continue
    assert stream.text == whole["choices"][0]["text"] == "fdjlhi"
    assert stream.logprobs == whole["choices"][0]["logprobs"]
    assert stream.finish_reason == whole["choices"][0]["finish_reason"] == "length"


def test_streamed_echo_with_max_tokens_zero_scores_the_prompt_only():
    whole, chunks = post({"prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 0})
    stream = joined(chunks)
    assert stream.text == whole["choices"][0]["text"] == "fdjl"
    assert stream.logprobs == whole["choices"][0]["logprobs"]
    lp = stream.logprobs
    assert len(lp["tokens"]) == len(PROMPT) and lp["token_logprobs"][0] is None
    assert (
        lp["top_logprobs"][1:]
        == [  # logprobs 0: the token itself, as vLLM
            {tok: score(t, i).logprob}
            for i, (t, tok) in enumerate(zip(PROMPT[1:], "djl", strict=True), 1)
        ]
    )
    assert stream.finish_reason == "length"


def test_streamed_echo_without_logprobs_sends_the_text_at_once():
    whole, chunks = post({"prompt": PROMPT, "echo": True, "max_tokens": 2})
    assert chunks[0]["choices"][0] == {
        "index": 0, "text": "fdjl", "logprobs": None, "finish_reason": None
    }  # fmt: skip
    assert joined(chunks).text == whole["choices"][0]["text"] == "fdjlhi"
    assert whole["choices"][0]["logprobs"] is None


def test_generated_tokens_top_lists_hold_the_chosen_token():
    whole, chunks = post({"prompt": PROMPT, "logprobs": 1, "max_tokens": 2})
    lp = whole["choices"][0]["logprobs"]
    assert lp["tokens"] == ["h", "i"]
    assert lp["top_logprobs"] == [
        {"d": -0.5, "h": score(7, 100).logprob},
        {"d": -0.5, "i": score(8, 101).logprob},
    ]
    assert joined(chunks).logprobs == lp
