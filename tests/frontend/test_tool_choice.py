"""tool_choice through the OpenAI API (frontend/tools.py, tool_use.py, tool_answer.py): an
engine that writes a given text, read by the parser the chat template tells (or the one
configured), answered as OpenAI answers, whole or streamed; "required" and a named function
reach the engine as a grammar; what cannot be honoured is a 400 naming the field.

Real aiohttp apps in this process, the built-in models' trained tokenizer, a scripted engine."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pdserve.config import FrontendConfig
from pdserve.frontend.api import OpenAIApi
from pdserve.frontend.tool_answer import ToolAnswer
from pdserve.frontend.tool_calls import Hermes
from pdserve.frontend.tool_use import ToolUse
from pdserve.frontend.tools import parse_tools
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.constraint import ConstraintKind
from pdserve.protocol.outputs import TokenLogprob
from tests.frontend.fakes import Scripted, app_with
from tests.frontend.tool_models import (
    EOS,
    TOOLS,
    assemble,
    hermes,
    sse_chunks,
    tokenizer,
    whole_calls,
    writer,
)

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
TOKYO_TIME = ("get_time", {"zone": "Asia/Tokyo"})
NAMED = {"type": "function", "function": {"name": "get_time"}}


def post(tok: Tokenizer, engine: Scripted, parser: str = "auto", **body: Any) -> tuple[int, Any]:
    """POST a chat to an API over `engine` (SSE bodies as their chunks)."""
    api = OpenAIApi(engine, tok, "m", 4096, 5.0, None, FrontendConfig(tool_call_parser=parser))

    async def go() -> tuple[int, Any]:
        async with TestClient(TestServer(app_with(api))) as client:
            r = await client.post(
                "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, **body}
            )
            if body.get("stream") and r.status == 200:
                return r.status, sse_chunks(await r.text())
            return r.status, await r.json()

    try:
        return asyncio.run(go())
    finally:
        api.close()


def both(tok: Tokenizer, text: str, **body: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The whole answer's choice and the streamed chunks, for an engine that writes `text`."""
    status, whole = post(tok, writer(tok, text), **body)
    assert status == 200, whole
    status, chunks = post(tok, writer(tok, text), stream=True, **body)
    assert status == 200, chunks
    return whole["choices"][0], chunks


def same_calls(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Equal but for the ids (new ones per answer), which must be OpenAI's form."""
    ids = [c["id"] for c in a + b]
    assert all(isinstance(i, str) and i.startswith("call_") for i in ids), ids
    strip = [[{k: v for k, v in c.items() if k != "id"} for c in x] for x in (a, b)]
    return strip[0] == strip[1]


def test_auto_answers_calls_whole_and_streamed_alike():
    tok = tokenizer()
    text = "Let me look.\n" + hermes(PARIS, TOKYO_TIME)
    choice, chunks = both(tok, text)
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] == "Let me look.\n"  # the text before the calls, verbatim
    calls = whole_calls(message)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [PARIS, TOKYO_TIME]
    assert all(c["type"] == "function" for c in message["tool_calls"])
    content, streamed, finish = assemble(chunks)
    assert (content, finish) == ("Let me look.\n", "tool_calls") and same_calls(streamed, calls)
    # A call's first delta carries its index, id, type and name; then only argument fragments.
    firsts = [
        tc
        for ch in chunks
        for c in ch["choices"]
        for tc in c["delta"].get("tool_calls", ())
        if "id" in tc
    ]
    assert [(f["index"], f["type"], f["function"]) for f in firsts] == [
        (0, "function", {"name": "get_weather", "arguments": ""}),
        (1, "function", {"name": "get_time", "arguments": ""}),
    ]
    last = chunks[-1]["choices"][0]
    assert last == {"index": 0, "logprobs": None, "finish_reason": "tool_calls", "delta": {}}


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("parallel", [True, False])
def test_a_choice_streamed_in_any_pieces_adds_up_to_the_whole(size, parallel):
    request = parse_tools({"tools": TOOLS, "parallel_tool_calls": parallel})
    use = ToolUse(request, Hermes, frozenset())
    text = "Hm. " + hermes(PARIS, TOKYO_TIME) + " ok"
    whole, reason = ToolAnswer(use).message("", text, "stop")
    answer, chunks = ToolAnswer(use), []
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for k, piece in enumerate(pieces):
        body = {"index": 0, "logprobs": None, "finish_reason": None, "delta": {}}
        last = k == len(pieces) - 1
        chunks += [{"choices": [b]} for b in answer.stream(body, piece, "stop" if last else None)]
    content, calls, finish = assemble(chunks)
    assert (content, finish) == (whole["content"], reason) == ("Hm.  ok", "tool_calls")
    assert same_calls(calls, whole_calls(whole)) and len(calls) == (2 if parallel else 1)
    if size == 1:  # arguments leave as they are written: a fragment per character
        fragments = [b for ch in chunks for b in ch["choices"] if "tool_calls" in b["delta"]]
        assert len(fragments) > len(PARIS[1]) * 4


def test_auto_without_calls_is_plain_content():
    tok = tokenizer()
    choice, chunks = both(tok, "It is sunny in Paris.")
    assert choice["message"] == {"role": "assistant", "content": "It is sunny in Paris."}
    assert choice["finish_reason"] == "stop"
    assert assemble(chunks) == ("It is sunny in Paris.", [], "stop")


def test_none_shows_the_tools_and_parses_nothing():
    tok = tokenizer()
    text = hermes(PARIS)
    engine = writer(tok, text)
    status, whole = post(tok, engine, tool_choice="none")
    assert status == 200
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert whole["choices"][0]["finish_reason"] == "stop"
    prompt = tok.decode(engine.prompts[0], skip_special_tokens=False)
    assert '"name": "get_time"' in prompt and engine.params[0].constraint is None
    status, chunks = post(tok, writer(tok, text), tool_choice="none", stream=True)
    assert assemble(chunks) == (text, [], "stop")


def test_parallel_tool_calls_false_answers_the_first_call_only():
    tok = tokenizer()
    choice, chunks = both(tok, hermes(PARIS, TOKYO_TIME), parallel_tool_calls=False)
    calls = whole_calls(choice["message"])
    assert [c["name"] for c in calls] == ["get_weather"]
    assert same_calls(assemble(chunks)[1], calls)


@pytest.mark.parametrize(
    "choice,names,parallel",
    [("required", ["get_weather", "get_time"], True), (NAMED, ["get_time"], False)],
)
def test_required_and_named_reach_the_engine_as_a_grammar_of_calls(choice, names, parallel):
    tok = tokenizer()
    engine = writer(tok, hermes(TOKYO_TIME))
    status, whole = post(tok, engine, tool_choice=choice)
    assert status == 200, whole
    constraint = engine.params[0].constraint
    assert constraint is not None and constraint.kind is ConstraintKind.GRAMMAR
    for name in ("get_weather", "get_time"):  # the envelope's name is a const of the schema
        assert (f'"const": "{name}"' in constraint.spec) is (name in names)
    assert ("call (" in constraint.spec) is parallel  # more calls may follow the first
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    assert whole["choices"][0]["message"]["content"] is None
    assert [c["function"]["name"] for c in whole["choices"][0]["message"]["tool_calls"]] == [
        "get_time"
    ]


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice",
         "'get_news', which 'tools' does not declare (declared: get_weather, get_time)"),
        ({"tool_choice": "sometimes"}, "tool_choice", "'tool_choice' must be"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
         "cannot apply besides"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools",
         "'tools[0].function.parameters' must be a JSON schema of an object"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools",
         "'tools[0].function.name'"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "'tools[1].function.name'"),
        ({"tools": [{"type": "tool", "function": {"name": "f"}}]}, "tools", "'tools[0]'"),
        ({"tools": [{"type": "function", "function": {"name": "f",
          "parameters": {"type": "object", "properties": {"x": {"type": "integerx"}}}}}],
          "tool_choice": "required"}, "tools", "cannot constrain the calls"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_a_400_naming_the_field(body, param, words):
    tok = tokenizer()
    engine = writer(tok, "x")
    status, answer = post(tok, engine, **body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and words in answer["error"]["message"], answer
    assert engine.prompts == []


def test_a_template_without_a_call_format_needs_the_flag():
    tok = tokenizer(HERMES_WITHOUT_CALLS)
    status, answer = post(tok, writer(tok, hermes(PARIS)))
    assert status == 400 and answer["error"]["param"] == "tools"
    assert "--tool-call-parser" in answer["error"]["message"]
    status, answer = post(tok, writer(tok, hermes(PARIS)), parser="hermes")
    assert status == 200 and answer["choices"][0]["finish_reason"] == "tool_calls"


HERMES_WITHOUT_CALLS = "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"


def test_a_marker_that_is_a_special_token_reaches_the_parser_but_not_the_content():
    """Mistral's [TOOL_CALLS] is a special token, which the client's default
    skip_special_tokens leaves out of the text: the parser still sees it; with "none" (no
    parser) it is left out of the content as any special token is."""
    tok = tokenizer(HERMES_WITHOUT_CALLS, special=("[TOOL_CALLS]", "<|x|>"))
    text = 'Sure.<|x|>[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    choice, chunks = both(tok, text, parser="mistral")  # tool_choice auto
    assert choice["message"]["content"] == "Sure."  # <|x|> skipped, [TOOL_CALLS] consumed
    calls = whole_calls(choice["message"])
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    assert len(calls[0]["id"]) == 9  # Mistral's ids
    content, streamed, finish = assemble(chunks)
    assert content == "Sure." and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == [("get_weather", '{"city": "Paris"}')]
    status, plain = post(tok, writer(tok, text), parser="mistral", tool_choice="none")
    assert plain["choices"][0]["message"]["content"] == 'Sure.[{"name": "get_weather", ' + (
        '"arguments": {"city": "Paris"}}]'
    )
    engine = writer(tok, text)
    post(tok, engine, parser="mistral", tool_choice="required")
    marker = tok.token_id("[TOOL_CALLS]")
    assert engine.params[0].constraint.spec.startswith(f"start: <[{marker}]> %json")


def test_streamed_logprobs_are_all_there_though_the_parser_holds_text():
    tok = tokenizer()
    ids = tok.encode("Hm. " + hermes(PARIS), add_special_tokens=False)

    def outputs(prompt: list[int], params: Any) -> list[tuple[Any, ...]]:
        scored = [(t, TokenLogprob(t, -0.5, ((t, -0.5),))) for t in [*ids, EOS]]
        return [((t,), (lp,), "stop" if t == EOS else None, None, 0) for t, lp in scored]

    body = {"logprobs": True, "top_logprobs": 1}
    status, whole = post(tok, Scripted(4200, 4096, outputs), **body)
    status, chunks = post(tok, Scripted(4200, 4096, outputs), stream=True, **body)
    streamed = [
        e["token"]
        for ch in chunks
        for c in ch["choices"]
        for e in (c["logprobs"] or {}).get("content", ())
    ]
    assert streamed == [e["token"] for e in whole["choices"][0]["logprobs"]["content"]]
    assert len(streamed) == len(ids) + 1  # the end's token too, as without tools
    assert assemble(chunks)[:1] == ("Hm. ",)
