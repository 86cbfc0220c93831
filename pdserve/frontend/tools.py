"""Tool use in a chat request: the `tools` it declares, the `tool_choice` it makes, and what the
model's chat template must be able to render for them.

- `tools`: at most MAX_TOOLS `{"type": "function", "function": {"name", "description"?,
  "parameters"?, "strict"?}}` objects. A name is 1 to MAX_NAME letters, digits, `_`, `-` or
  `.` (OpenAI's rule, and what every call format can write), given once; `parameters` is a
  JSON schema of an object (absent: no parameters). The list reaches the chat template as
  sent (its `tools` variable), whatever the choice.
- `tool_choice`: "none" (the model sees the tools and answers in text, nothing is parsed),
  "auto" (the default with tools: the model decides; its output is parsed for calls),
  "required" (one or more calls to declared functions), or
  `{"type": "function", "function": {"name": N}}` (one call to N, which must be declared).
  Without tools, "none" and "auto" ask for nothing; "required" or a name is a 400.
- `parallel_tool_calls` (default true): false keeps at most one call per choice.
- `tool` messages and assistant `tool_calls` reach a template that renders them
  (Tokenizer.chat_template_support, read from the template's source); with one that does not
  (the built-in ChatML), 400 naming the role; `tools` with a template that takes no tool
  list, 400 naming `tools`: the model could not see them.

How calls are parsed and constrained is frontend/tool_use.py's. `parse_tools` runs with the
body (I/O-free, InvalidParams naming the field); `check_template` once the tokenizer is at hand.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.model.tokenizer import ChatTemplateSupport
from pdserve.protocol.sampling import InvalidParams, show

MAX_TOOLS = 128
MAX_NAME = 64  # characters of a function name (OpenAI's bound)
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ChoiceKind(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"  # one call to the function `ToolRequest.named`


@dataclass(frozen=True)
class Function:
    """A declared function: its name and the JSON schema of its arguments (an object)."""

    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools and what it asks of them."""

    tools: tuple[dict[str, Any], ...]  # as sent: what the chat template renders
    functions: tuple[Function, ...]  # the same, checked
    choice: ChoiceKind
    named: str | None = None  # the function a NAMED choice calls
    parallel: bool = True  # more than one call per choice allowed
    choice_given: bool = False  # the body held tool_choice (errors name it, else `tools`)

    @property
    def parses(self) -> bool:
        """Whether the output is read for tool calls."""
        return bool(self.functions) and self.choice is not ChoiceKind.NONE

    @property
    def forced(self) -> tuple[Function, ...]:
        """The functions the output must call one of (required, named); () when the model
        may answer in text."""
        if self.choice is ChoiceKind.REQUIRED:
            return self.functions
        if self.choice is ChoiceKind.NAMED:
            return tuple(f for f in self.functions if f.name == self.named)
        return ()

    @property
    def field(self) -> str:
        """The field an error about this request's tool use names."""
        return "tool_choice" if self.choice_given else "tools"


NO_TOOLS = ToolRequest((), (), ChoiceKind.AUTO)


def parse_tools(body: dict[str, Any]) -> ToolRequest:
    """The body's tools and tool choice, checked; InvalidParams naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidParams(
            f"'parallel_tool_calls' must be true or false, got {show(parallel)}",
            "parallel_tool_calls",
        )
    functions = _functions(tools) if tools is not None else ()
    kind, named = _choice(choice, functions)
    return ToolRequest(
        tuple(tools or ()), functions, kind, named, parallel is not False, choice is not None
    )


def _functions(tools: Any) -> tuple[Function, ...]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidParams(
            f"'tools' must be a list of at most {MAX_TOOLS} function definitions, "
            f"got {show(tools)}",
            "tools",
        )
    out: list[Function] = []
    for i, t in enumerate(tools):
        f = _function(t, f"tools[{i}]")
        if any(g.name == f.name for g in out):
            raise InvalidParams(
                f"'tools[{i}].function.name': {f.name!r} is declared twice", "tools"
            )
        out.append(f)
    return tuple(out)


def _function(t: Any, where: str) -> Function:
    if not isinstance(t, dict) or t.get("type") != "function":
        raise InvalidParams(
            f'\'{where}\' must be {{"type": "function", "function": {{...}}}}, got {show(t)}',
            "tools",
        )
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise InvalidParams(f"'{where}.function' must be an object, got {show(fn)}", "tools")
    name = fn.get("name")
    if not (
        isinstance(name, str) and 0 < len(name) <= MAX_NAME and all(c in NAME_CHARS for c in name)
    ):
        raise InvalidParams(
            f"'{where}.function.name' must be 1 to {MAX_NAME} letters, digits, '_', '-' or '.', "
            f"got {show(name)}",
            "tools",
        )
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise InvalidParams(f"'{where}.function.description' must be a string", "tools")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise InvalidParams(f"'{where}.function.strict' must be true or false", "tools")
    params = fn.get("parameters")
    if params is None:
        return Function(name, NO_PARAMETERS)
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise InvalidParams(
            f"'{where}.function.parameters' must be a JSON schema of an object, got {show(params)}",
            "tools",
        )
    return Function(name, {"type": "object", **params})


def _choice(choice: Any, functions: tuple[Function, ...]) -> tuple[ChoiceKind, str | None]:
    if choice is None:
        return ChoiceKind.AUTO, None
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        kind = ChoiceKind(choice)
    else:
        fn = choice.get("function") if isinstance(choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not (isinstance(choice, dict) and choice.get("type") == "function" and name):
            raise InvalidParams(
                "'tool_choice' must be 'none', 'auto', 'required' or "
                f'{{"type": "function", "function": {{"name": ...}}}}, got {show(choice)}',
                "tool_choice",
            )
        if not any(f.name == name for f in functions):
            declared = ", ".join(f.name for f in functions) or "none"
            raise InvalidParams(
                f"'tool_choice' names the function {show(name)}, which 'tools' does not "
                f"declare (declared: {declared})",
                "tool_choice",
            )
        return ChoiceKind.NAMED, name
    if kind is ChoiceKind.REQUIRED and not functions:
        raise InvalidParams("'tool_choice' 'required' needs 'tools' to call", "tool_choice")
    return kind, None


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
            "'tools' is not supported by this model's chat template (it takes no tool list, "
            "so the model could not see them)",
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
