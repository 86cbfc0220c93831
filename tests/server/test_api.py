"""The OpenAI API of a real `pdserve serve` process, driven by the official openai client."""

from __future__ import annotations

import http.client as httpclient
import json
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import openai
import pytest

from pdserve.model.tokenizer import Tokenizer
from tests.procs import http
from tests.protocol.hostile_specs import lark_chain, longest, ref_chain

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", timeout=60)


def greedy(client, prompt: str, n: int = 12, **kw):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, **kw)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_and_stream_agree(client):
    full = greedy(client, "def main():")
    c = full.choices[0]
    assert c.finish_reason in ("length", "stop") and c.text
    assert full.usage.prompt_tokens > 0 and full.usage.completion_tokens <= 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="def main():",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == c.text
    finals = [
        ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason
    ]
    assert finals == [c.finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_length_finish_counts_tokens(client):
    r = client.completions.create(
        model="tiny", prompt="hello", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7


def test_chat_and_chat_stream(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    m = r.choices[0].message
    assert m.role == "assistant" and r.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True
    )
    parts = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
    assert "".join(parts) == m.content


def test_stop_string_cuts_text(client):
    base = greedy(client, "import os", 16, extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) > 6
    stop = base[3:6]
    cut = base[: base.index(stop)]
    r = greedy(client, "import os", 16, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    s = client.completions.create(
        model="tiny",
        prompt="import os",
        max_tokens=16,
        temperature=0,
        stop=[stop],
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(ch.choices[0].text for ch in s if ch.choices) == cut


def test_logprobs(client):
    r = greedy(client, "x = 1", 5, logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(  # vLLM's N or N+1: the three best, and the chosen token when not among them
        len(t) in (3, 4) and lp.tokens[i] in t and max(t.values()) >= lp.token_logprobs[i] - 1e-5
        for i, t in enumerate(lp.top_logprobs)
    )
    c = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "a"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = c.choices[0].logprobs.content
    assert content and all(len(e.top_logprobs) == 2 for e in content)


def test_seeded_sampling_reproducible_and_n(client):
    kw = dict(
        model="tiny",
        prompt="the",
        max_tokens=12,
        temperature=1.0,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
    both = client.completions.create(**{**kw, "n": 2})
    assert [c.index for c in both.choices] == [0, 1] and both.choices[0].text == a
    assert both.usage.completion_tokens == 24


def test_concurrent_streams_match_greedy(client):
    prompts = [f"line {i}: " + "word " * (i * 3) for i in range(16)]
    alone = [greedy(client, p, 8, extra_body={"ignore_eos": True}).choices[0].text for p in prompts]

    def streamed(p: str) -> str:
        s = client.completions.create(
            model="tiny",
            prompt=p,
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join(ch.choices[0].text for ch in s if ch.choices)

    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(streamed, prompts))
    assert together == alone


BAD = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": ["a", 3]}, "prompt"),
    ({"prompt": [999999]}, "prompt"),
    ({"prompt": "word " * 5000}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_input_is_400_with_openai_error(tiny_server, body, param):
    status, resp = http("POST", tiny_server.url + "/v1/completions", {"model": "tiny", **body})
    assert status == 400, resp
    assert resp["error"]["type"] == "invalid_request_error" and resp["error"]["param"] == param
    assert resp["error"]["message"]


def test_malformed_json_unknown_model_and_chat_errors(tiny_server):
    status, resp = http("POST", tiny_server.url + "/v1/completions", raw=b"{not json")
    assert status == 400 and "JSON" in resp["error"]["message"]
    status, resp = http(
        "POST", tiny_server.url + "/v1/completions", {"model": "gpt-9", "prompt": "x"}
    )
    assert status == 404 and resp["error"]["code"] == "model_not_found"
    status, resp = http("POST", tiny_server.url + "/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and resp["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x").completions.create(
            model="tiny", prompt="x", temperature=-3
        )
    # None of it disturbed the server.
    assert http("GET", tiny_server.url + "/health")[0] == 200
    status, resp = http(
        "POST",
        tiny_server.url + "/v1/completions",
        {"model": "tiny", "prompt": "ok", "max_tokens": 2},
    )
    assert status == 200 and resp["choices"][0]["text"] is not None


def test_hostile_constraints_are_answered_and_the_server_lives(tiny_server):
    """Constraints that overflow an ordinary stack in llguidance's compiler (a rule chain, a
    `$ref` chain: protocol/grammar_thread.py) compile, on the front end and in the engine, and
    JSON text nested past Python's recursion limit is a 400 naming its field."""
    url = tiny_server.url + "/v1/completions"
    base = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    status, resp = http("POST", url, {**base, "guided_json": "[" * 50_000})
    assert status == 400 and resp["error"]["param"] == "guided_json", resp
    for field, spec in [
        ("guided_grammar", longest(lark_chain)),
        ("guided_json", longest(ref_chain)),
    ]:
        status, resp = http("POST", url, {**base, field: spec})
        assert status == 200 and resp["choices"][0]["finish_reason"] in ("stop", "length"), resp
    assert http("GET", tiny_server.url + "/health")[0] == 200


def test_a_gbnf_grammar_is_served(tiny_server):
    """A GBNF grammar (converted to Lark in a child process of the server's:
    runtime/gbnf_converter.py) constrains the answer in either field that carries one; one that
    does not convert is a 400 naming its field."""
    url = tiny_server.url + "/v1/completions"
    base = {"model": "tiny", "prompt": "x", "max_tokens": 8}
    gbnf = 'root ::= "(" answer ")"\nanswer ::= "yes" | "no"'
    for body in [{"guided_grammar": gbnf}, {"structured_outputs": {"grammar": gbnf}}]:
        status, resp = http("POST", url, {**base, **body})
        assert status == 200, resp
        choice = resp["choices"][0]
        assert (choice["text"], choice["finish_reason"]) in {("(yes)", "stop"), ("(no)", "stop")}
    status, resp = http("POST", url, {**base, "guided_grammar": "garbage !!! ###"})
    assert status == 400 and resp["error"]["param"] == "guided_grammar", resp
    assert "does not convert" in resp["error"]["message"], resp


def wait_idle(url: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        state = http("GET", url + "/debug/state")[1]
        eng = state["engine"]
        if not eng["requests"] and eng["pool"]["pages_used"] == eng["pool"]["pages_cached"]:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout_s}s: {eng}")
        time.sleep(0.1)


def test_disconnect_mid_stream_aborts_and_frees_pages(tiny_server):
    u = urlparse(tiny_server.url)
    conn = httpclient.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(
            {
                "model": "tiny",
                "prompt": "abc " * 20,
                "max_tokens": 800,
                "stream": True,
                "ignore_eos": True,
            }
        ),
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(3):
        assert resp.readline().startswith(b"data: ")
        resp.readline()
    state = http("GET", tiny_server.url + "/debug/state")[1]
    assert state["engine"]["requests"], "the request should still be running"
    conn.sock.close()
    conn.close()
    state = wait_idle(tiny_server.url)
    assert all(t["alive"] for t in state["threads"])
    assert http("GET", tiny_server.url + "/health")[0] == 200


def test_metrics_and_debug_state(tiny_server):
    greedy_body = {"model": "tiny", "prompt": "metrics", "max_tokens": 3}
    assert http("POST", tiny_server.url + "/v1/completions", greedy_body)[0] == 200
    _, text = http("GET", tiny_server.url + "/metrics")
    for name in (
        "pdserve_requests_running",
        "pdserve_requests_waiting",
        "pdserve_kv_pages_used",
        "pdserve_kv_pages_total",
        "pdserve_generation_tokens_total",
        "pdserve_time_to_first_token_seconds_bucket",
        "pdserve_inter_token_latency_seconds_bucket",
    ):
        assert name in text, name
    gen = [ln for ln in text.splitlines() if ln.startswith("pdserve_generation_tokens_total")]
    assert float(gen[0].split()[-1]) >= 3
    state = wait_idle(tiny_server.url)
    assert state["engine"]["pool"]["pages_total"] > 0
    assert [t["name"] for t in state["threads"]] == ["engine"]


# -- issue 14 parts 3 and 4, through the official client -------------------------------------


def test_streamed_echo_with_logprobs_matches_the_whole_answer(client):
    kw = dict(model="tiny", prompt="def f(x):", echo=True, logprobs=2, temperature=0)
    for n in (0, 3):
        whole = client.completions.create(**kw, max_tokens=n).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(**kw, max_tokens=n, stream=True)]
        assert chunks[0].text == "def f(x):" and chunks[0].logprobs.token_logprobs[0] is None
        lp = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        for c in chunks:
            for k in lp:
                lp[k] += getattr(c.logprobs, k) if c.logprobs else []
        assert "".join(c.text for c in chunks) == whole.text
        assert lp == whole.logprobs.model_dump(), n
        shown = [  # offsets point into the text (the BOS it leaves out takes no room)
            whole.text.startswith(t, o)
            for t, o in zip(lp["tokens"], lp["text_offset"], strict=True)
            if t[:2] != "<|"
        ]
        assert len(shown) >= 4 + n and all(shown)


def test_logit_bias_logprobs_true_and_partial_character_keys(client, tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    target = tok.encode(" zebra", add_special_tokens=False)[0]
    r = greedy(client, "import os", 1, logit_bias={str(target): 100}, logprobs=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == tok.decode([target])
    assert len(lp.top_logprobs[0]) in (1, 2) and lp.tokens[0] in lp.top_logprobs[0]
    partial = next(i for i in range(tok.vocab_size) if "\ufffd" in tok.token_to_str(i))
    r = greedy(client, "import os", 1, logit_bias={str(partial): 100}, logprobs=1)
    lp = r.choices[0].logprobs  # vLLM's rendering: the decoded text, in tokens and keys alike
    assert lp.tokens == ["\ufffd"] and lp.top_logprobs[0]["\ufffd"] == lp.token_logprobs[0]


def test_include_stop_str_in_output(client):
    base = greedy(client, "import os", 16, extra_body={"ignore_eos": True}).choices[0].text
    stop = base[3:6]
    kept = greedy(
        client, "import os", 16, stop=[stop],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )  # fmt: skip
    assert kept.choices[0].text == base[: base.index(stop) + 3]


CHAT = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}


@pytest.mark.parametrize(
    "call,param",
    [
        (lambda c: c.completions.create(model="tiny", prompt="x", best_of=2), "best_of"),
        (lambda c: c.completions.create(model="tiny", prompt="x", suffix="y"), "suffix"),
        (
            lambda c: c.completions.create(
                model="tiny", prompt="x", stream_options={"include_usage": True}
            ),
            "stream_options",
        ),
        (lambda c: c.chat.completions.create(model="tiny", messages=CHAT, tools=[TOOL]), "tools"),
        (
            lambda c: c.chat.completions.create(
                model="tiny",
                messages=CHAT,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "objectx"}},
                },
            ),
            "response_format.json_schema.schema",
        ),
        (
            lambda c: c.chat.completions.create(
                model="tiny", messages=[{"role": "tool", "content": "1", "tool_call_id": "a"}]
            ),
            "messages",  # the built-in ChatML template renders no tool messages
        ),
    ],
)
def test_refused_fields_are_400_naming_the_field(client, call, param):
    with pytest.raises(openai.BadRequestError) as e:
        call(client)
    assert e.value.param == param and e.value.status_code == 400


def test_unknown_fields_are_ignored_by_default(client):
    r = greedy(client, "x", 2, extra_body={"no_such_field": 1})
    assert r.choices[0].text is not None


def test_model_card_404_and_405_are_openai_errors(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        client.get("/no/such/route", cast_to=object)
    assert e.value.body["message"]
    with pytest.raises(openai.APIStatusError) as e:
        client.get("/completions", cast_to=object)
    assert e.value.status_code == 405 and e.value.body["message"]
