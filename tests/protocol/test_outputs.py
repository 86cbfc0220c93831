"""The /generate NDJSON line codec: what a worker writes, the router reads back exactly."""

from __future__ import annotations

import json

import pytest

from pdserve.protocol.outputs import (
    RequestOutput,
    TokenLogprob,
    decode_line,
    encode_line,
    encode_lines,
)

OUT = RequestOutput("r", (4, 5), (TokenLogprob(4, -0.5, ((4, -0.5), (9, -1.0))),), "stop", None, 7)


def test_a_line_round_trips_and_has_the_documented_shape() -> None:
    raw = encode_line(OUT)
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    assert decode_line(raw, "r") == OUT
    assert json.loads(raw) == {
        "request_id": "r",
        "token_ids": [4, 5],
        "logprobs": [[4, -0.5, [[4, -0.5], [9, -1.0]]]],
        "finish_reason": "stop",
        "error": None,
        "num_prompt_tokens": 7,
        "prompt_logprobs": [],
    }
    for finish in (None, "length", "abort", "error"):
        o = RequestOutput("r", (), finish_reason=finish, error="e" if finish else None)
        assert decode_line(encode_line(o), "r") == o


def test_many_lines_in_one_call_are_each_line_joined() -> None:
    outs = [OUT, RequestOutput("s", (1,)), RequestOutput("t", (), finish_reason="abort")]
    assert encode_lines(outs) == b"".join(encode_line(o) for o in outs)
    assert encode_lines([]) == b""


def line(**fields: object) -> bytes:
    return json.dumps({"request_id": "r", "token_ids": [1], **fields}).encode()


@pytest.mark.parametrize(
    "raw,words",
    [
        (b"not json", "malformed output line"),
        (b"[1]", "malformed output line"),
        (b"{}", "malformed output line"),
        (json.dumps({"token_ids": [1]}).encode(), "missing required field `request_id`"),
        (line(token_ids=["a"]), "malformed output line"),
        (line(token_ids=[True]), "malformed output line"),
        (line(token_ids=[1.0]), "malformed output line"),
        (line(token_ids=[2**70]), "malformed output line"),
        (line(token_ids=[-1]), "malformed output line"),
        (line(logprobs=[[1, -0.5, [[-3, -1.0]]]]), "malformed output line"),
        (line(num_prompt_tokens=-1), "malformed output line"),
        (line(logprobs=[[1, "x", []]]), "malformed output line"),
        (line(logprobs=None), "malformed output line"),
        (line(num_prompt_tokens="3"), "malformed output line"),
        (line(finish_reason="maybe"), "unknown finish_reason 'maybe'"),
        (line(request_id="other"), "an output of request 'other' in the stream of 'r'"),
    ],
)
def test_a_malformed_line_is_a_value_error(raw: bytes, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[")):
        decode_line(raw, "r")
