"""What a tool-call parser gives back: the calls, and the streamed deltas they arrive as.

A call's `arguments` is the model's own JSON text of the arguments object, exactly as it was
generated (checked to be valid JSON, never re-serialised), so the `ArgumentsDelta` fragments
of a streamed call concatenate to the very string a whole-text parse returns.

The deltas are typed (`ContentDelta | CallStart | ArgumentsDelta`); `openai_delta` gives the
`delta` object of an OpenAI chat.completion.chunk for each: `{"content": ...}`, or
`{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]}`
for a call's first chunk and `{"tool_calls": [{"index", "function": {"arguments": ...}}]}`
for the fragments after it.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

_ALPHANUMERIC = string.ascii_letters + string.digits


class Malformed(ValueError):
    """The text inside a tool-call region is not a call: the parser turns it into content."""


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str  # the JSON text of the arguments object, as the model wrote it


class Parsed(NamedTuple):
    content: str  # the text outside the calls (whitespace-only text beside a call dropped)
    calls: tuple[ToolCall, ...]


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int  # 0, 1, ... in the order the calls start
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    index: int
    text: str


Delta = ContentDelta | CallStart | ArgumentsDelta


def new_call_id() -> str:
    """An OpenAI-style tool call id: call_ and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def new_mistral_call_id() -> str:
    """Nine random letters and digits: Mistral's chat templates refuse any other tool call id
    when the call comes back in the next turn."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


def openai_delta(delta: Delta) -> dict[str, Any]:
    """The `delta` object of an OpenAI chat.completion.chunk carrying `delta`."""
    match delta:
        case ContentDelta(text):
            return {"content": text}
        case CallStart(index, call_id, name):
            function = {"name": name, "arguments": ""}
            return {
                "tool_calls": [
                    {"index": index, "id": call_id, "type": "function", "function": function}
                ]
            }
        case ArgumentsDelta(index, text):
            return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}
    raise TypeError(f"not a tool-call delta: {delta!r}")


def assemble(deltas: Iterable[Delta]) -> Parsed:
    """The content and calls a stream of deltas adds up to."""
    content: list[str] = []
    starts: dict[int, CallStart] = {}
    arguments: dict[int, list[str]] = {}
    for d in deltas:
        match d:
            case ContentDelta(text):
                content.append(text)
            case CallStart(index):
                starts[index] = d
                arguments[index] = []
            case ArgumentsDelta(index, text):
                arguments[index].append(text)
    calls = tuple(
        ToolCall(starts[i].id, starts[i].name, "".join(arguments[i])) for i in sorted(starts)
    )
    return Parsed("".join(content), calls)
