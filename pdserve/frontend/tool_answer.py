"""A chat answer with tool calls, as OpenAI gives it: each choice's output read by the
request's parser (frontend/tool_use.py), whole or as it streams.

Whole: `message.tool_calls` = `[{id, type: "function", function: {name, arguments}}]`, the
arguments the model's own JSON text; `content` the text outside the calls, null when there is
none beside calls. Streamed: the text's deltas (`{"content"}`), and per call a first delta
`{"tool_calls": [{index, id, type, function: {name, arguments: ""}}]}` then its arguments'
fragments (call.py `openai_delta`), which add up to the whole answer's arguments: the parser
fed the pieces and the parser fed the whole text agree (tool_calls/stream.py). A choice that
called a tool and stopped ends with finish_reason "tool_calls", streamed in a last chunk of
its own; without `parallel_tool_calls` only its first call is answered.
"""

from __future__ import annotations

from typing import Any

from pdserve.frontend.tool_calls import (
    ArgumentsDelta,
    CallStart,
    Delta,
    ToolCall,
    openai_delta,
)
from pdserve.frontend.tool_use import ToolUse

CALLED = "tool_calls"  # the finish_reason of a choice that called a tool


class ToolAnswer:
    """The tool calls of one answer's choices: a streaming reader per choice, made on first
    use, or a whole-text parse."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self._readers: dict[int, _Reader] = {}

    def message(
        self, prefix: str, text: str, reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """A whole choice's `message` and finish_reason: `text` is its output (read for
        calls), `prefix` what is shown before it (chat's echo)."""
        parsed = self.use.parser.parse(text)
        calls = parsed.calls if self.use.parallel else parsed.calls[:1]
        content = prefix + parsed.content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["content"] = content or None
            message["tool_calls"] = [_call(c) for c in calls]
        return message, _finish(reason, bool(calls))

    def stream(self, body: dict[str, Any], text: str, reason: str | None) -> list[dict[str, Any]]:
        """The chunk bodies of one streamed delta: `body` is its choice's body as plain
        content would be (index, delta, logprobs, finish_reason), `text` the delta's text,
        `reason` its finish_reason. The logprobs go on the first body; the finish, read
        for calls, on a last one of its own."""
        index = body["index"]
        reader = self._readers.get(index)
        if reader is None:
            reader = self._readers[index] = _Reader(self.use)
        logprobs = body["logprobs"]
        out = []
        for delta in reader.feed(text, final=reason is not None):
            out.append({**body, "delta": openai_delta(delta), "logprobs": logprobs})
            out[-1]["finish_reason"] = None
            logprobs = None
        if reason is not None:
            end = {
                "delta": {},
                "logprobs": logprobs,
                "finish_reason": _finish(reason, reader.called),
            }
            out.append({**body, **end})
        elif not out and logprobs is not None:  # scored tokens whose text the parser holds
            out.append({**body, "delta": {}})
        return out


class _Reader:
    """One choice's output as it streams, through its own parser."""

    def __init__(self, use: ToolUse) -> None:
        self.parser = use.parser()
        self.parallel = use.parallel
        self.called = False

    def feed(self, text: str, final: bool) -> list[Delta]:
        deltas = self.parser.feed(text) if text else []
        if final:
            deltas += self.parser.finish()
        kept = [d for d in deltas if self.parallel or not _later_call(d)]
        self.called = self.called or any(isinstance(d, CallStart) for d in kept)
        return kept


def _later_call(d: Delta) -> bool:
    """A delta of a call after the first (answered only with parallel_tool_calls)."""
    return isinstance(d, CallStart | ArgumentsDelta) and d.index > 0


def _call(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _finish(reason: str | None, called: bool) -> str | None:
    return CALLED if called and reason == "stop" else reason
