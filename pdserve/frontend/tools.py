"""Tool use in chat: what pdserve passes to the model's chat template, and what it refuses.

pdserve renders; it does not parse tool calls out of the generated text. So:
- `tool` messages (and assistant messages with `tool_calls`) reach the chat template when the
  template renders them (Tokenizer.chat_template_support, read from the template's source);
  with a template that does not (the built-in ChatML), 400 naming the role.
- `tools` reaches the template (its `tools` variable) only with `tool_choice: "none"`: the
  model sees the tools and answers in text, as vLLM does with "none". Any other choice
  (`auto`, OpenAI's default when tools are given, `required`, a named function) asks for
  parsed tool calls: 400 naming the field. A template that takes no `tools`: 400 naming `tools`.
- An empty `tools` and tool_choice "none" or "auto" ask for nothing and pass.

`parse_tools` runs with the body (I/O-free); `check_template` once the tokenizer is at hand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pdserve.model.tokenizer import ChatTemplateSupport
from pdserve.protocol.sampling import InvalidParams, show

MAX_TOOLS = 128

_NO_PARSER = "pdserve does not parse tool calls from the output"


def parse_tools(body: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """The tools to render into the prompt (maybe none); InvalidParams naming the field for
    what pdserve cannot honour."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise InvalidParams(
            f"'tool_choice' {show(choice)} is not supported: {_NO_PARSER}; "
            "only 'none' (with 'tools') or 'auto' (without)",
            "tool_choice",
        )
    if tools is None or tools == []:
        return ()
    if not (isinstance(tools, list) and len(tools) <= MAX_TOOLS and all(map(_is_tool, tools))):
        raise InvalidParams(
            f"'tools' must be a list of at most {MAX_TOOLS} "
            '{"type": "function", "function": {"name": ...}} objects',
            "tools",
        )
    if choice != "none":
        field = "tools" if choice is None else "tool_choice"
        raise InvalidParams(
            f"'{field}': with tools, tool_choice {show(choice or 'auto')} asks for tool calls, "
            f"and {_NO_PARSER}; send tool_choice 'none' to show the tools to the model",
            field,
        )
    return tuple(tools)


def _is_tool(t: Any) -> bool:
    fn = t.get("function") if isinstance(t, dict) else None
    return (
        isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(fn, dict)
        and isinstance(fn.get("name"), str)
    )


def check_template(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[Any],
    support_of_template: Callable[[], ChatTemplateSupport],
) -> None:
    """InvalidParams naming what the model's chat template cannot render; asks the template
    (`support_of_template`) only when the request holds something beyond plain turns."""
    if not tools and not any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        return
    support = support_of_template()
    if tools and not support.tools:
        raise InvalidParams(
            "'tools' is not supported by this model's chat template (it takes no tool list)",
            "tools",
        )
    for i, m in enumerate(messages):
        if m["role"] == "tool" and not support.tool_messages:
            raise InvalidParams(
                f"messages[{i}]: role 'tool' is not supported by this model's chat template "
                "(it renders system, user and assistant messages)",
                "messages",
            )
        if m.get("tool_calls") and not support.tool_calls:
            raise InvalidParams(
                f"messages[{i}]: 'tool_calls' is not supported by this model's chat template",
                "messages",
            )
