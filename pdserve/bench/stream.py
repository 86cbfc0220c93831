"""The SSE stream of one OpenAI streaming response -> a RequestRecord's timings and counts.

A token event is an SSE chunk that carries output: non-empty text, or a choice that has not
finished yet (a server may send a token whose text it holds back, e.g. half a UTF-8
character). The chat role preamble and a trailing empty chunk that only carries the
finish_reason are not token events. A chunk may carry several tokens (a server that fell
behind merges what waits, as vLLM and pdserve do): it is one token event, so ITLs are the
gaps between chunks, as vLLM's benchmark measures them. The finishing chunk is ambiguous:
vLLM puts the last token in it; pdserve does when it merged it there, else sends it after
the last token with only the held-back text flushed. So
when the server reports usage, a finishing chunk that would make the events outnumber the
tokens is not counted. TTFT is send -> first token event; ITLs are the gaps between token
events; the output token count is the server's `usage.completion_tokens` when it sends
usage, else the number of token events.

Sans-I/O: the caller feeds lines with their arrival time; every line of one network read
shares that read's time, which is when the client could first have seen it.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from pdserve.bench.record import ErrorKind, RequestRecord

_DONE = b"[DONE]"
_decode = msgspec.json.decode  # a quarter of json.loads' time on a small chunk
FAILED_FINISH = ("error", "abort")  # pdserve says error; vLLM says abort


def fail(rec: RequestRecord, kind: ErrorKind, detail: str) -> None:
    if rec.error is None:  # the first cause wins; what follows is usually its echo
        rec.error, rec.error_detail = kind, detail


class StreamParser:
    def __init__(self, rec: RequestRecord, sent: float) -> None:
        self.rec, self.sent = rec, sent
        self.last: float | None = None  # time of the latest token event
        self.events = 0
        self.finish_event = False  # the latest token event was the finishing chunk
        self.usage_tokens: int | None = None
        self.done = False  # [DONE] seen

    def line(self, raw: bytes, now: float) -> bool:
        """Take one line; True once the stream is over ([DONE])."""
        line = raw.strip()
        if not line.startswith(b"data:"):
            return False  # blank separators, comments, event: lines
        data = line[5:].strip()
        if data == _DONE:
            self.done = True
            return True
        rec = self.rec
        try:
            obj = _decode(data)
        except ValueError:
            fail(rec, ErrorKind.BAD_RESPONSE, f"not JSON: {data[:100]!r}")
            return False
        if not isinstance(obj, dict):
            fail(rec, ErrorKind.BAD_RESPONSE, f"not a JSON object: {data[:100]!r}")
            return False
        if "error" in obj:
            detail = json.dumps(obj["error"])[:300]
            if rec.error is ErrorKind.STREAM_ERROR:  # the event explains an error finish
                rec.error_detail = detail
            fail(rec, ErrorKind.STREAM_ERROR, detail)
            return False
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage_tokens = usage.get("completion_tokens", self.usage_tokens)
            rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
        choices = obj.get("choices") or []
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            fail(rec, ErrorKind.BAD_RESPONSE, f"'choices' is not a list of objects: {data[:100]!r}")
            return False
        for choice in choices:
            self._choice(choice, now)
        return False

    def _choice(self, choice: dict[str, Any], now: float) -> None:
        rec = self.rec
        finish = choice.get("finish_reason")
        if _is_token_event(choice, finish):
            self.events += 1
            rec.output_tokens = self.events  # a stream cut short keeps what it got
            self.finish_event = finish is not None
            if self.last is None:
                rec.ttft = now - self.sent
            else:
                rec.itl.append(now - self.last)
            self.last = now
        if finish is not None:
            rec.finish_reason = finish
            if finish in FAILED_FINISH:
                fail(rec, ErrorKind.STREAM_ERROR, f"finish_reason {finish}")

    def finish(self) -> None:
        """The stream ended (or [DONE] came): settle the token count, spot a cut stream."""
        rec = self.rec
        if isinstance(self.usage_tokens, int):
            if self.finish_event and self.events > self.usage_tokens and rec.itl:
                rec.itl.pop()  # the finishing chunk only flushed text (see the module doc)
                self.events -= 1
            rec.output_tokens = self.usage_tokens
        if not self.done and rec.finish_reason is None:
            fail(rec, ErrorKind.INCOMPLETE, f"stream ended after {self.events} token events")


def _is_token_event(choice: dict[str, Any], finish: str | None) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, dict):  # chat
        text = delta.get("content") or delta.get("reasoning_content")
        return bool(text) or (finish is None and "role" not in delta)
    return bool(choice.get("text")) or finish is None
