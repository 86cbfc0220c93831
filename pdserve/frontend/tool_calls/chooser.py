"""Which tool-call parser a model needs: named by `--tool-call-parser`, or told by its chat
template, which renders an assistant's past calls in the very form the model writes them.

Detection looks for each format's markers in the template's source, most specific first:

| parser | the template contains |
|---|---|
| deepseek_v3 | `<｜tool▁calls▁begin｜>` |
| mistral | `[TOOL_CALLS]` |
| hermes | `<tool_call>`, but not `<function=` (Qwen3-Coder's XML calls, not JSON) |
| llama3_json | `<|python_tag|>`, or Llama 3's headers with a `"parameters"` envelope |

A template with none of them (plain ChatML, as SmolLM2-135M-Instruct's) renders no calls:
no parser, and the caller refuses tool calls for that model.
"""

from __future__ import annotations

from pdserve.frontend.tool_calls.deepseek_v3 import CALLS_BEGIN, DeepSeekV3
from pdserve.frontend.tool_calls.hermes import OPEN, Hermes
from pdserve.frontend.tool_calls.llama3_json import PYTHON_TAG, Llama3Json
from pdserve.frontend.tool_calls.mistral import TOOL_CALLS, Mistral
from pdserve.frontend.tool_calls.stream import StreamParser

PARSERS: dict[str, type[StreamParser]] = {
    cls.name: cls for cls in (Hermes, Llama3Json, Mistral, DeepSeekV3)
}
AUTO = "auto"  # --tool-call-parser's default: detect it from the chat template


def parser_named(name: str) -> type[StreamParser]:
    """The parser `--tool-call-parser NAME` names; ValueError listing the names otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; known: {known}") from None


def detect(template: str | None) -> type[StreamParser] | None:
    """The parser whose markers the chat template's source holds; None for none."""
    if not template:
        return None
    if CALLS_BEGIN in template:
        return DeepSeekV3
    if TOOL_CALLS in template:
        return Mistral
    if OPEN in template:
        return None if "<function=" in template else Hermes
    if PYTHON_TAG in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return Llama3Json
    return None


def choose(name: str | None, template: str | None) -> type[StreamParser] | None:
    """`name`'s parser (None or AUTO: the one `template` tells, or None)."""
    if name is None or name == AUTO:
        return detect(template)
    return parser_named(name)
