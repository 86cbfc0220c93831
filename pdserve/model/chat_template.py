"""Chat templates: render a Jinja chat template the way HF transformers renders it.

One sandboxed environment (`environment()`) with HF's options, globals and filters, so a prompt
built here tokenizes to the same ids as HF's. It renders the model's own template
(Tokenizer.apply_chat_template) and, in a child process, a template a client sent
(frontend/template_jail.py): the same environment either way, and it has no loader, so a
template can neither include nor import anything, let alone a file.

`continue_final` is HF's `continue_final_message`: the rendered chat is cut right after the
last message's content, so the model continues that message instead of starting a new one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, NamedTuple, NoReturn

import jinja2
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateSupport(NamedTuple):
    """What a chat template can render beyond plain turns, read from its source (its syntax
    tree): a template that never mentions a thing drops it silently or renders it wrongly."""

    tool_messages: bool  # compares a role with "tool" (or "ipython", Llama 3's name for it)
    tools: bool  # reads the `tools` variable (the tool list OpenAI's `tools` field holds)
    tool_calls: bool  # reads an assistant message's `tool_calls`


NO_TEMPLATE_SUPPORT = ChatTemplateSupport(False, False, False)


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
) -> str:
    """`template` rendered over `messages` (HF's apply_chat_template(..., tokenize=False)).
    ValueError if the template does not parse or rejects the input."""
    compiled = compile_template(template)
    try:
        return compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template rejected the request: {e}") from e
    except Exception as e:
        # Hub templates index and filter the caller's messages freely, so malformed input
        # surfaces as TypeError, KeyError, ...: still the request's fault, not ours.
        raise ValueError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e


def continue_final(rendered: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """`rendered` cut after the last message's content, as HF's continue_final_message cuts
    it (a template that trims the content's trailing spaces is cut after the trimmed text).
    ValueError if the rendered chat does not hold that content."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str):
        raise ValueError("continue_final_message needs a final message with text content")
    if final.strip() not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat "
            "the template renders (the template changes it)"
        )
    at = rendered.rindex(final.strip())
    if rendered[at : at + len(final.lstrip())] == final:
        return rendered[: at + len(final.lstrip())]
    return rendered[: at + len(final.strip())]


def template_support(template: str) -> ChatTemplateSupport:
    """What `template` renders beyond plain turns. ValueError if it does not parse."""
    return _support(template)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; templates expect plain JSON, as HF renders it.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """Accepts `{% generation %}...{% endgeneration %}` and renders the body unchanged.

    HF uses the tag to mark assistant tokens for training masks; some templates contain it,
    and without this extension they would not parse at all.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


@lru_cache(maxsize=1)
def environment() -> ImmutableSandboxedEnvironment:
    """The one environment every chat template renders in. The sandbox keeps a template from
    reaching Python; it does not bound what a template costs (template_jail.py does)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# What the renderer sets itself, besides the special tokens: its parameters and the
# environment's globals. A client's chat_template_kwargs may not replace them.
RENDERER_NAMES = frozenset(
    {"messages", "add_generation_prompt", "tools", "documents", "continue_final_message"}
    | set(environment().globals)
)


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    try:
        return environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse (line {e.lineno}): {e.message}") from e


_TOOL_ROLES = frozenset({"tool", "ipython"})


@lru_cache(maxsize=16)
def _support(template: str) -> ChatTemplateSupport:
    try:
        tree = environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse (line {e.lineno}): {e.message}") from e
    consts = {n.value for n in tree.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}
    attrs = {n.attr for n in tree.find_all(jinja2.nodes.Getattr)}
    return ChatTemplateSupport(
        tool_messages=bool(consts & _TOOL_ROLES),
        tools="tools" in jinja2.meta.find_undeclared_variables(tree),
        tool_calls="tool_calls" in consts | attrs,
    )
