"""The SSE parser alone: which chunks are tokens, when, and how a stream ends."""

from __future__ import annotations

import json
from typing import Any

from pdserve.bench.record import ErrorKind, RequestRecord
from pdserve.bench.stream import StreamParser


def data(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode()


def chat(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return data({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def feed(lines: list[tuple[bytes, float]], sent: float = 0.0) -> RequestRecord:
    rec = RequestRecord(0, "main", 0.0, 4, 3)
    parser = StreamParser(rec, sent)
    for line, now in lines:
        if parser.line(line, now):
            break
    parser.finish()
    return rec


def test_chat_role_preamble_is_not_a_token_and_crlf_is_fine() -> None:
    rec = feed(
        [
            (chat({"role": "assistant", "content": ""}) + b"\r", 0.5),
            (b"\r", 0.5),
            (b": keep-alive comment", 0.6),
            (chat({"content": "a"}), 1.0),
            (chat({"content": "b"}), 1.5),
            (chat({"content": "c"}, "length"), 2.5),
            (data({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}), 2.6),
            (b"data: [DONE]", 2.7),
        ]
    )
    assert rec.ok and rec.finish_reason == "length"
    assert (rec.ttft, rec.itl, rec.output_tokens, rec.prompt_tokens) == (1.0, [0.5, 1.0], 3, 4)


def test_without_usage_the_token_events_are_counted() -> None:
    rec = feed([(chat({"content": "a"}), 1.0), (chat({}, "stop"), 2.0), (b"data: [DONE]", 2.0)])
    assert rec.ok and rec.output_tokens == 1 and rec.itl == []


def test_an_error_finish_keeps_the_error_events_message() -> None:
    rec = feed(
        [
            (chat({"content": "a"}), 1.0),
            (chat({}, "error"), 1.1),
            (data({"error": {"message": "decode worker died"}}), 1.1),
            (b"data: [DONE]", 1.2),
        ]
    )
    assert rec.error is ErrorKind.STREAM_ERROR
    assert rec.error_detail is not None and "decode worker died" in rec.error_detail


def test_a_stream_cut_short_is_incomplete_and_keeps_its_tokens() -> None:
    rec = feed([(chat({"content": "a"}), 1.0), (chat({"content": "b"}), 2.0)])
    assert rec.error is ErrorKind.INCOMPLETE and rec.output_tokens == 2
