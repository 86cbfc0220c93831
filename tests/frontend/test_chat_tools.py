"""Tool use in chat (frontend/tools.py): `tool` messages, assistant `tool_calls` and `tools`
reach a chat template that renders them, and are refused with a 400 naming them by one that
does not (the built-in ChatML); a template that shows no tool call format leaves no parser
for calls (auto, required, named: a 400 naming --tool-call-parser), while "none" passes.

Real aiohttp apps in this process, the built-in models' real tokenizer, an engine that keeps
the prompt it was given."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import Tokenizer as HFTokenizer

from pdserve.frontend.api import OpenAIApi
from pdserve.model.builtin import CHATML_TEMPLATE, trained_tokenizer_json
from pdserve.model.tokenizer import ChatTemplateSupport, Tokenizer
from pdserve.protocol.outputs import RequestOutput
from tests.frontend.fakes import app_with

# A template that renders tools, tool calls and tool results (after Qwen2.5's, much shortened).
TOOL_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% elif m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
LLAMA3_STYLE = "{% for m in messages %}{% if m.role == 'ipython' %}x{% endif %}{% endfor %}"

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
TURNS = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny 21C"},
]


class PromptKeeper:
    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def validate(self, prompt_ids: list[int], params: Any) -> None:
        pass

    def submit(self, rid: str, prompt: list[int], params: Any, sink: Any,
               timeout_s: Any = None, **extra: Any) -> None:  # fmt: skip
        self.prompts.append(prompt)
        sink(RequestOutput(rid, (0,), (), "length", None, len(prompt)))

    def abort(self, rid: str) -> None:
        pass


def tokenizer(template: str) -> Tokenizer:
    backend = HFTokenizer.from_str(trained_tokenizer_json())
    return Tokenizer(backend, frozenset(), None, {}, template)


def chat(template: str, **body: Any) -> tuple[int, dict[str, Any], str | None]:
    """(status, JSON body, the rendered prompt the engine got or None)."""
    tok, engine = tokenizer(template), PromptKeeper()
    api = OpenAIApi(engine, tok, "m", 4096, 5.0)

    async def go() -> tuple[int, dict[str, Any]]:
        async with TestClient(TestServer(app_with(api))) as client:
            r = await client.post("/v1/chat/completions", json={"max_tokens": 1, **body})
            return r.status, await r.json()

    status, resp = asyncio.run(go())
    prompt = tok.decode(engine.prompts[0], skip_special_tokens=False) if engine.prompts else None
    return status, resp, prompt


def test_what_templates_support_is_read_from_their_source():
    assert tokenizer(CHATML_TEMPLATE).chat_template_support == ChatTemplateSupport(
        False, False, False
    )
    assert tokenizer(TOOL_TEMPLATE).chat_template_support == ChatTemplateSupport(True, True, True)
    assert tokenizer(LLAMA3_STYLE).chat_template_support.tool_messages


def test_a_template_with_tools_gets_tool_messages_calls_and_tools():
    status, resp, prompt = chat(TOOL_TEMPLATE, messages=TURNS, tools=[TOOL], tool_choice="none")
    assert status == 200, resp
    assert prompt is not None
    assert '"name": "get_weather"' in prompt  # the tool list, as the template's tojson writes it
    assert "<tool_call>get_weather</tool_call>" in prompt
    assert "<tool_response>sunny 21C</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"messages": TURNS[2:]}, "messages", "role 'tool'"),
        ({"messages": TURNS[:2]}, "messages", "'tool_calls'"),
        ({"messages": TURNS[:1], "tools": [TOOL], "tool_choice": "none"}, "tools", "'tools'"),
    ],
)
def test_chatml_refuses_what_it_cannot_render_naming_it(body, param, words):
    status, resp, prompt = chat(CHATML_TEMPLATE, **body)
    assert status == 400 and prompt is None
    assert resp["error"]["param"] == param and words in resp["error"]["message"]


# TOOL_TEMPLATE less its call markup: it shows the tools, but not how the model calls them.
NO_CALL_FORMAT = TOOL_TEMPLATE.replace("<tool_call>", "[").replace("</tool_call>", "]")
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tools": [TOOL]}, "tools"),  # OpenAI's default with tools is "auto": calls
        ({"tools": [TOOL], "tool_choice": "auto"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": NAMED}, "tool_choice"),
    ],
)  # fmt: skip
def test_calls_without_a_known_parser_are_refused_naming_the_flag(extra, param):
    status, resp, prompt = chat(NO_CALL_FORMAT, messages=TURNS[:1], **extra)
    assert status == 400 and resp["error"]["param"] == param and prompt is None, resp
    assert "no tool call parser is known" in resp["error"]["message"]
    assert "--tool-call-parser" in resp["error"]["message"]
    status, resp, _ = chat(NO_CALL_FORMAT, messages=TURNS[:1], tools=[TOOL], tool_choice="none")
    assert status == 200, resp


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools"),
        ({"tools": "get_weather", "tool_choice": "none"}, "tools"),
    ],
)
def test_tools_that_are_not_function_definitions_are_refused(extra, param):
    status, resp, _ = chat(TOOL_TEMPLATE, messages=TURNS[:1], **extra)
    assert status == 400 and resp["error"]["param"] == param, resp
