"""A real `pdserve serve` process (no API key) answers what third-party clients of vLLM send:
/tokenize, /detokenize, /version, /ping, an unknown path's 404, the context error litellm
recognises, continue_final_message and prompt_logprobs, through raw HTTP and the official
openai client. The PD router's side: tests/router/test_router_pd.py."""

from __future__ import annotations

import openai
import pytest

from pdserve.frontend.api import VERSION
from pdserve.model.tokenizer import Tokenizer
from tests.procs import http

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

CONTEXT = 1024  # tiny_server's --max-model-len
TURNS = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "The colour is"},
]


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


def test_tokenize_detokenize_version_ping(tiny_server, tiny_dir):
    url, tok = tiny_server.url, Tokenizer.from_dir(tiny_dir)
    status, got = http("POST", url + "/tokenize", {"model": "tiny", "prompt": "hello world"})
    ids = tok.encode("hello world")
    assert status == 200
    assert got == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids, "token_strs": None}
    status, got = http("POST", url + "/tokenize", {"messages": TURNS[:1]})
    assert got["tokens"] == tok.encode(tok.apply_chat_template(TURNS[:1]), add_special_tokens=False)
    detok = http("POST", url + "/detokenize", {"tokens": ids})
    assert detok == (200, {"prompt": "<|endoftext|>hello world"})  # the BOS: specials kept
    assert http("GET", url + "/version") == (200, {"version": VERSION})
    for method in ("GET", "POST"):
        status, got = http(method, url + "/ping")
        assert status == 200 and got["status"] == "ok"


def test_an_unknown_path_is_an_openai_style_404(tiny_server):
    status, got = http("GET", tiny_server.url + "/no/such/path", auth=False)
    assert status == 404 and got["error"]["type"] == "invalid_request_error"


def test_the_context_error_is_the_one_clients_recognise(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=CONTEXT)
    assert e.value.code == "context_length_exceeded"
    assert "This model's maximum context length is 1024 tokens" in e.value.message


def test_continue_final_message_through_the_openai_client(client, tiny_server):
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    r = client.chat.completions.create(
        model="tiny",
        messages=TURNS,
        max_tokens=3,
        temperature=0,
        extra_body={**flags, "echo": True},
    )
    assert r.choices[0].message.content.startswith("The colour is")  # echoed, then continued
    status, got = http("POST", tiny_server.url + "/tokenize", {"messages": TURNS, **flags})
    assert r.usage.prompt_tokens == got["count"]


def test_prompt_logprobs_through_the_openai_client(client):
    r = client.completions.create(
        model="tiny", prompt="def main():", max_tokens=1, temperature=0,
        extra_body={"prompt_logprobs": 2},
    )  # fmt: skip
    shown = r.choices[0].model_extra["prompt_logprobs"]
    assert shown[0] is None and len(shown) == r.usage.prompt_tokens
    for position in shown[1:]:
        assert 1 <= len(position) <= 3
        assert all(
            v["logprob"] <= 0 and isinstance(v["decoded_token"], str) for v in position.values()
        )
