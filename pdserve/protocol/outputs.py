"""What an engine emits for one request, and the NDJSON line codec of a worker's output streams
(one request's `/generate` stream, or a router's shared `/outputs` stream).

The worker writes each RequestOutput as one line of msgspec JSON (`encode_line`); the router
reads each line back with a decoder typed by RequestOutput (`decode_line`, `decode_output` for
a shared stream, which carries every request's outputs), which refuses
anything else with a ValueError: bad JSON, a wrong type anywhere, an unknown finish_reason,
or another request's id. A TokenLogprob travels as an array `[id, logprob, [[id, lp], ...]]`,
in `logprobs` (generated tokens) and `prompt_logprobs` (the prompt's, on the first line).

Sans-I/O and torch-free: the router imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec

FINISH_REASONS = frozenset({"stop", "length", "abort", "error"})
LINE_QUOTE_LIMIT = 200  # bytes of a malformed line worth quoting in the error
MAX_ABORT_IDS = 1024  # request ids in one POST /abort to a worker (worker/http/api.py)

# Bounds msgspec checks when it decodes a line (construction checks nothing: the engine
# builds an output per token). msgspec's JSON decoder takes ints of any size otherwise.
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: TokenId
    logprob: float
    top: tuple[tuple[TokenId, float], ...]  # (token id, logprob), best first


# The error text of a request that its own deadline ended (the engine writes it; the OpenAI
# front end answers it with 408, not 500: the request asked for more than its timeout allowed,
# nothing on the server failed). A prefix, so the state can follow it.
DEADLINE_ERROR = "request exceeded its deadline"


def is_deadline_error(error: str | None) -> bool:
    return error is not None and error.startswith(DEADLINE_ERROR)


class RequestOutput(msgspec.Struct, frozen=True):
    """What the engine emits for a request: new tokens, and the end when it comes."""

    request_id: str
    token_ids: tuple[TokenId, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    num_prompt_tokens: Count = 0
    # Asked by params.prompt_logprobs, on a request's first output only: one entry per prompt
    # token after the first (the first has no context to be scored in).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(RequestOutput)


def encode_line(out: RequestOutput) -> bytes:
    """One NDJSON line, newline included."""
    return _encoder.encode(out) + b"\n"


def encode_lines(outs: Sequence[RequestOutput]) -> bytes:
    """`encode_line` of each, joined, in one C call: it runs on the worker's event loop, which
    shares the GIL with the engine thread (benchmarks/codec/stream_encode.py)."""
    return _encoder.encode_lines(outs)


def decode_output(line: bytes) -> RequestOutput:
    """A line of a shared output stream (any request's) -> its RequestOutput; ValueError if
    malformed."""
    try:
        out = _decoder.decode(line)
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed output line {line[:LINE_QUOTE_LIMIT]!r}: {e}") from None
    if out.finish_reason is not None and out.finish_reason not in FINISH_REASONS:
        raise ValueError(f"unknown finish_reason {out.finish_reason[:LINE_QUOTE_LIMIT]!r}")
    return out


def decode_line(line: bytes, request_id: str) -> RequestOutput:
    """A line of request_id's /generate stream -> its RequestOutput; ValueError if malformed."""
    out = decode_output(line)
    if out.request_id != request_id:
        raise ValueError(
            f"an output of request {out.request_id[:LINE_QUOTE_LIMIT]!r} "
            f"in the stream of {request_id!r}"
        )
    return out
