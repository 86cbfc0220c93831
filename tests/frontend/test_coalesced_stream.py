"""Outputs that pile up while a stream is busy go out merged (frontend/generation.py,
server/output_stream.py), and the answer is exactly the token-by-token one: text, logprobs,
finish_reason, usage, stop strings (the tokens past a stop string are never counted), EOS,
n > 1 and echo.

A real aiohttp app in this process over a fake engine that emits each answer either all at
once, before the stream's task runs (so everything merges), or one output per loop turn."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pdserve.frontend.api import OpenAIApi
from pdserve.protocol.outputs import RequestOutput, TokenLogprob
from pdserve.protocol.sampling import SamplingParams, validate_prompt
from tests.frontend.fakes import Tokenizer, app_with

VOCAB, MAX_LEN = 100, 64
ANSWER = (0, 1, 2, 3, 4, 5)  # "abcdef" in the fake tokenizer


class Engine:
    """Emits ANSWER[:max_tokens], one token per output, the last with `finish`; `burst`:
    every output inside submit (they reach the stream together), else one per loop turn."""

    def __init__(self, burst: bool, finish: str = "length") -> None:
        self.burst, self.finish = burst, finish
        self.tasks: set[asyncio.Task[None]] = set()

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_ids, params, VOCAB, MAX_LEN)

    def outputs(self, rid: str, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
        toks = ANSWER[: params.max_tokens]
        n = params.logprobs
        return [
            RequestOutput(
                rid,
                (t,),
                (TokenLogprob(t, -0.25 * (i + 1), ((t, -0.25 * (i + 1)),)[: n or 0]),)
                if n is not None
                else (),
                self.finish if i == len(toks) - 1 else None,
                None,
                len(prompt),
            )
            for i, t in enumerate(toks)
        ]

    def submit(self, rid: str, prompt: list[int], params: SamplingParams, sink: Any,
               timeout_s: Any = None, **extra: Any) -> None:  # fmt: skip
        outs = self.outputs(rid, prompt, params)
        if self.burst:
            for o in outs:
                sink(o)
            return

        async def spaced() -> None:
            for o in outs:
                sink(o)
                await asyncio.sleep(0.002)

        task = asyncio.get_running_loop().create_task(spaced())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def abort(self, rid: str) -> None:
        pass


def stream(engine: Engine, body: dict[str, Any]) -> list[dict[str, Any]]:
    api = OpenAIApi(engine, Tokenizer(), "m", MAX_LEN, 5.0)

    async def go() -> str:
        async with TestClient(TestServer(app_with(api))) as client:
            r = await client.post("/v1/completions", json={**body, "stream": True})
            assert r.status == 200
            return await r.text()

    events = [e[6:] for e in asyncio.run(go()).split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def joined(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Every choice put back together, and the usage."""
    out: dict[int, dict[str, Any]] = {}
    usage = None
    for ch in chunks:
        usage = ch.get("usage") or usage
        for c in ch["choices"]:
            j = out.setdefault(c["index"], {"text": "", "finish": None, "lp": {}, "chunks": 0})
            j["text"] += c["text"]
            j["finish"] = c["finish_reason"] or j["finish"]
            j["chunks"] += 1
            for k, v in (c["logprobs"] or {}).items():
                j["lp"].setdefault(k, []).extend(v)
    return {"choices": out, "usage": usage}


BODIES = [
    {"prompt": [7, 8], "max_tokens": 6, "logprobs": 1},
    {"prompt": [7, 8], "max_tokens": 6, "logprobs": 0, "stop": ["cd"]},
    {"prompt": [7, 8], "max_tokens": 6, "stop": ["cd"], "include_stop_str_in_output": True},
    {"prompt": [7, 8], "max_tokens": 6, "n": 2, "logprobs": 1, "echo": True},
    {"prompt": [[7, 8], [9]], "max_tokens": 4, "stop": ["c"]},
]


@pytest.mark.parametrize("finish", ["length", "stop"])
@pytest.mark.parametrize("body", BODIES)
def test_a_merged_stream_is_the_token_by_token_answer(body: dict[str, Any], finish: str) -> None:
    body = {**body, "stream_options": {"include_usage": True}}
    merged = joined(stream(Engine(burst=True, finish=finish), body))
    spaced = joined(stream(Engine(burst=False, finish=finish), body))
    for i, c in merged["choices"].items():
        s = spaced["choices"][i]
        assert (c["text"], c["finish"], c["lp"]) == (s["text"], s["finish"], s["lp"])
    assert merged["usage"] == spaced["usage"]
    # The burst really merged: one chunk carries the whole answer (plus echo's own chunk).
    assert all(c["chunks"] <= 2 for c in merged["choices"].values())


def test_a_stop_string_inside_a_merged_output_ends_the_tokens_there() -> None:
    body = {"prompt": [7, 8], "max_tokens": 6, "logprobs": 0, "stop": ["cd"],
            "stream_options": {"include_usage": True}}  # fmt: skip
    got = joined(stream(Engine(burst=True), body))
    c = got["choices"][0]
    assert c["text"] == "ab" and c["finish"] == "stop"
    assert c["lp"]["tokens"] == ["a", "b", "c", "d"]  # up to the token completing the stop
    assert got["usage"]["completion_tokens"] == 4  # "e" and "f" came in the burst: not counted


def test_eos_is_stripped_from_the_text_but_counted() -> None:
    body = {"prompt": [7, 8], "max_tokens": 3, "stream_options": {"include_usage": True}}
    got = joined(stream(Engine(burst=True, finish="stop"), body))
    assert got["choices"][0]["text"] == "ab"  # "c" is the stop token (EOS)
    assert got["usage"]["completion_tokens"] == 3
