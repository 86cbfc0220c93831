"""Scoring a prompt through /v1/completions of a real co-located server, as lm-eval does:
`echo` + `logprobs` + `max_tokens: 0` gives every prompt token, the first with a null logprob,
and text offsets over the echoed text."""

from __future__ import annotations

import pytest

from tests.procs import http

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


def score(url: str, **body):
    return http("POST", url + "/v1/completions", {"model": "tiny", **body})


def test_echo_max_tokens_zero_scores_every_prompt_token(tiny_server):
    ids = [5, 17, 300, 42, 999, 7]
    status, body = score(tiny_server.url, prompt=ids, echo=True, logprobs=2, max_tokens=0)
    assert status == 200, body
    c = body["choices"][0]
    lp = c["logprobs"]
    assert c["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
    assert all(2 <= len(t) <= 3 for t in lp["top_logprobs"][1:])  # vLLM: 2 best + the token
    # offsets walk the echoed text token by token
    assert lp["text_offset"][0] == 0
    for i in range(1, len(ids)):
        assert lp["text_offset"][i] == lp["text_offset"][i - 1] + len(lp["tokens"][i - 1])
    assert "".join(lp["tokens"]) == c["text"]


def test_echo_logprobs_with_generation_continue_the_offsets(tiny_server):
    ids = [5, 17, 300, 42]
    status, body = score(
        tiny_server.url,
        prompt=ids,
        echo=True,
        logprobs=1,
        max_tokens=3,
        temperature=0,
        ignore_eos=True,
    )
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None
    assert lp["text_offset"][len(ids)] == sum(len(t) for t in lp["tokens"][: len(ids)])


def test_max_tokens_zero_without_echo_is_refused(tiny_server):
    status, body = score(tiny_server.url, prompt="hello", max_tokens=0)
    assert status == 400
    assert body["error"]["param"] == "max_tokens"
