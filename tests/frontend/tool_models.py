"""What the tool-call tests share: a chat template in Qwen2.5's Hermes form (it lists the tools
and shows calls as `<tool_call>` blocks, so the parser is told by it), two functions, the
built-in models' trained tokenizer (with a format's markers added as special tokens), an
engine that writes a given text, and how a client assembles streamed tool calls."""

from __future__ import annotations

import json
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from pdserve.model.builtin import trained_tokenizer_json
from pdserve.model.tokenizer import Tokenizer
from tests.frontend.fakes import Scripted

# After Qwen2.5's template: the tools in the system turn, calls and results as it renders them.
HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou are a helpful assistant.\\n\\n# Tools\\n\\n"
    "You may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content }}"
    "{{- '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    "{%- for c in m.tool_calls %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + c.function.name + \'", "arguments": \' '
    "+ (c.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def function(name: str, description: str, **properties: dict[str, Any]) -> dict[str, Any]:
    params = {"type": "object", "properties": properties, "required": list(properties)}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": params},
    }


WEATHER = function(
    "get_weather",
    "Get the current weather in a city",
    city={"type": "string", "maxLength": 40},
    unit={"type": "string", "enum": ["celsius", "fahrenheit"]},
)
TIME = function("get_time", "Get the local time in a time zone", zone={"type": "string"})
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
EOS = 4095  # <|im_end|> in the trained tokenizer


def tokenizer(template: str | None = HERMES_TEMPLATE, special: tuple[str, ...] = ()) -> Tokenizer:
    """The built-in models' tokenizer, `special` added as special tokens (a format's markers)."""
    backend = HFTokenizer.from_str(trained_tokenizer_json())
    if special:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return Tokenizer(backend, frozenset({EOS}), None, {}, template)


def writer(tok: Tokenizer, text: str, max_len: int = 4096) -> Scripted:
    """An engine that writes `text`, a token per output, then ends it with EOS ("stop")."""
    ids = tok.encode(text, add_special_tokens=False)

    def outputs(prompt: list[int], params: Any) -> list[tuple[Any, ...]]:
        steps: list[tuple[Any, ...]] = [((t,), (), None, None, len(prompt)) for t in ids]
        return [*steps, ((EOS,), (), "stop", None, len(prompt))]

    return Scripted(tok.vocab_size + 8, max_len, outputs)


def hermes(*calls: tuple[str, dict[str, Any]]) -> str:
    """Calls as the Hermes format writes them."""
    return "\n".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls
    )


def assemble(chunks: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], str | None]:
    """A choice's streamed chunks as a client adds them up (openai's stream helpers): the
    content, each call's id, name and concatenated arguments by index, the last finish."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.get("choices", ()):
            delta = choice["delta"]
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls", ()):
                call = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.get("id") or call["id"]
                fn = tc.get("function", {})
                call["name"] += fn.get("name") or ""
                call["arguments"] += fn.get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


def whole_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole answer's calls in `assemble`'s form."""
    return [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls") or ()
    ]


def sse_chunks(raw: str) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE body, up to [DONE]."""
    out = []
    for event in raw.split("\n\n"):
        data = event.removeprefix("data: ").strip()
        if data and data != "[DONE]":
            out.append(json.loads(data))
    return out
