"""A chat request's prompt: its messages as the chat template sees them, and how they render.

`parse_chat_prompt(body, tools)` checks the fields that shape the prompt (vLLM's rules):
- `messages`: content a string or a list of text parts (joined); `developer` is `system`; an
  assistant's null content is "". An assistant's `tool_calls[].function.arguments` reaches the
  template as an object, as vLLM passes it: OpenAI sends a JSON string, and a template that
  writes it with `tojson` (Qwen2.5's) would encode it twice. null or "" is {}; a string that
  is not a JSON object is a 400.
- `add_generation_prompt` (default true) and `continue_final_message` (default false): both
  true is a 400, as in vLLM; `continue_final_message` alone turns the generation prompt off
  and leaves the last message open (model/chat_template.py `continue_final`).
- `chat_template`: a client's own Jinja template, at most MAX_TEMPLATE_CHARS, rendered by
  frontend/template_jail.py (the model's sandbox, in a helper process with limits); never a
  path.
- `chat_template_kwargs`: extra template variables: identifier keys, none of the names the
  renderer sets itself (RESERVED_TEMPLATE_NAMES: the messages, the flags, the tools, the
  special tokens, the environment's globals), so a client cannot replace `messages`.
- `echo`: the last message's content is shown before each choice's completion when its role
  is the one the answer continues (vLLM's rule: "assistant" with a generation prompt, else the
  last message's own role).

I/O-free; errors are ApiError 400s naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.model.chat_template import RENDERER_NAMES
from pdserve.protocol.sampling import show
from pdserve.server.api_error import ApiError, bad
from pdserve.server.json_body import check_json

MAX_TEMPLATE_CHARS = 64 * 1024  # a client's chat_template; hub templates are at most ~16 KiB
RESERVED_TEMPLATE_NAMES = RENDERER_NAMES | {
    "self",
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
}
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatPrompt:
    """What renders a chat request's prompt."""

    messages: tuple[dict[str, Any], ...]
    kwargs: dict[str, Any]  # Tokenizer.apply_chat_template's keyword arguments
    template: str | None  # the client's chat_template; None: the model's
    echo: str  # what `echo` shows before each choice's completion ("" for nothing)

    @property
    def add_generation_prompt(self) -> bool:
        return bool(self.kwargs["add_generation_prompt"])

    @property
    def continue_final_message(self) -> bool:
        return bool(self.kwargs.get("continue_final_message", False))

    @property
    def variables(self) -> dict[str, Any]:
        """The template variables besides the messages and the two flags."""
        skip = ("add_generation_prompt", "continue_final_message")
        return {k: v for k, v in self.kwargs.items() if k not in skip}


def parse_chat_prompt(body: dict[str, Any], tools: tuple[dict[str, Any], ...]) -> ChatPrompt:
    """The prompt-shaping fields of a chat body (or a /tokenize body with `messages`);
    `tools`: the tool list to render (frontend/tools.py decides), maybe empty."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    norm = tuple(_message(m, i) for i, m in enumerate(messages))
    gen_prompt = _flag(body, "add_generation_prompt", None)
    continue_final = _flag(body, "continue_final_message", False)
    if continue_final and gen_prompt:
        raise bad(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    gen_prompt = not continue_final if gen_prompt is None else gen_prompt
    kwargs: dict[str, Any] = {"add_generation_prompt": gen_prompt}
    if continue_final:
        kwargs["continue_final_message"] = True
    if tools:
        kwargs["tools"] = list(tools)
    kwargs.update(_template_kwargs(body))
    last = norm[-1]
    answer_role = "assistant" if gen_prompt else last["role"]
    echoed = bool(_flag(body, "echo", False)) and last["role"] == answer_role
    return ChatPrompt(norm, kwargs, _template(body), last["content"] if echoed else "")


def _flag(body: dict[str, Any], name: str, default: bool | None) -> bool | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false, got {type(v).__name__}", name)
    return v


def _template(body: dict[str, Any]) -> str | None:
    template = body.get("chat_template")
    if template is None:
        return None
    if not isinstance(template, str) or not template.strip():
        raise bad("'chat_template' must be a non-empty string (a Jinja template)", "chat_template")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise bad(
            f"'chat_template' is {len(template)} characters; at most {MAX_TEMPLATE_CHARS}",
            "chat_template",
        )
    return template


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """chat_template_kwargs become template variables: identifiers only, and none of the
    names the renderer sets itself (a clash is a TypeError there, or silently wins)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise bad(
            f"'chat_template_kwargs' must be an object, got {type(kwargs).__name__}",
            "chat_template_kwargs",
        )
    for k in kwargs:
        if not (isinstance(k, str) and k.isidentifier()) or k in RESERVED_TEMPLATE_NAMES:
            raise bad(
                f"'chat_template_kwargs' keys must be identifiers other than "
                f"{', '.join(sorted(RESERVED_TEMPLATE_NAMES))}; got {show(k)}",
                "chat_template_kwargs",
            )
    return dict(kwargs)


def _message(m: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object", "messages")
    role = m.get("role")
    if role not in ROLES:
        raise bad(
            f"{where}.role must be system, user, assistant or tool, got {show(role)}", "messages"
        )
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise bad(f"{where}.content: only text parts are supported", "messages")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise bad(f"{where}.content must be a string or a list of text parts", "messages")
    out = {
        **{k: v for k, v in m.items() if k != "content"},
        "role": "system" if role == "developer" else role,
        "content": content,
    }
    if role == "assistant" and m.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(m["tool_calls"], where)
    return out


def _tool_calls(calls: Any, where: str) -> list[Any]:
    """An assistant's tool calls with each `function.arguments` an object (vLLM's
    _postprocess_messages); a call that is not {"function": {...}} passes as sent."""
    if not isinstance(calls, list):
        raise bad(f"{where}.tool_calls must be a list", "messages")
    out: list[Any] = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            out.append(call)
            continue
        args = _arguments(fn.get("arguments"), f"{where}.tool_calls[{j}].function.arguments")
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def _arguments(args: Any, where: str) -> dict[str, Any]:
    if args is None or args == "":
        return {}
    if isinstance(args, dict):
        return args
    if not isinstance(args, str):
        raise bad(f"{where} must be a JSON object or a string holding one", "messages")
    try:
        parsed = json.loads(args)
    except RecursionError as e:
        raise bad(f"{where} nests too deep", "messages") from e
    except ValueError as e:
        raise bad(f"{where} is not valid JSON: {e}", "messages") from e
    if not isinstance(parsed, dict):
        raise bad(f"{where} must hold a JSON object, got {type(parsed).__name__}", "messages")
    try:
        check_json(parsed)  # the body's own bounds: depth, lone surrogates
    except ApiError as e:
        raise bad(f"{where}: {e.message}", "messages") from e
    return parsed
