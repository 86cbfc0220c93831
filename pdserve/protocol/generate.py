"""A worker's /generate body: the one wire form the router writes and the worker reads
(step 1 of the request flow in docs/architecture.md).

`Generate` is a typed msgspec struct. The router builds it from what its front end has
checked and writes it with `encode_generate`; it is not checked again there (a struct's
checks here run on decoding, not on construction). The worker reads it with
`decode_generate`, the one decoder: msgspec's typed decoding checks every field's type in C
(the prompt ids too: D's event loop shares the GIL with the engine thread), refuses unknown
fields, lone surrogates and bytes that are not UTF-8, and runs SamplingParams' checks; then
the checks no type states (a printable id, a control address, a timeout's range). The depth
of what is read is bounded by the type (params.logit_bias's pairs are the deepest, 4 levels):
msgspec refuses a value of the wrong type at its first byte, before reading into it. Every
refusal is InvalidParams naming the field (protocol/json_errors.py), which the worker
answers as a 400. Whether the model can serve the prompt is the engine's own check
(`validate_prompt`), which it runs when the request is submitted.

`prefill` and `channel` are absent, never null, when not used: UNSET is left out of the
encoding, and a null is refused.
"""

from __future__ import annotations

import msgspec

from pdserve.protocol.control_address import is_control_address
from pdserve.protocol.json_errors import explain
from pdserve.protocol.sampling import InvalidParams, SamplingParams, is_number, show

MAX_REQUEST_ID_CHARS = 256
MAX_TIMEOUT_S = 1e6  # a client's or a /generate timeout, in seconds


class Generate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """POST /generate: one request for a decode (or co-located) worker."""

    request_id: str  # 1 to MAX_REQUEST_ID_CHARS printable characters
    prompt_ids: list[int]  # a bool or a float is refused
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    timeout_s: float | None = None  # in (0, MAX_TIMEOUT_S]; None: the worker's own
    prefill: str | msgspec.UnsetType = msgspec.UNSET  # P's control address; absent: D prefills
    # The router's output channel on D (worker/http/channels.py); absent: /generate streams
    # the request's own outputs.
    channel: str | msgspec.UnsetType = msgspec.UNSET


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Generate)


def encode_generate(body: Generate) -> bytes:
    """The body as JSON (TypeError or ValueError if a field cannot be encoded)."""
    return _ENCODER.encode(body)


def decode_generate(raw: bytes) -> Generate:
    """A /generate body (JSON in UTF-8) -> its checked fields; InvalidParams naming the field
    for anything wrong, and nothing else, whatever `raw` holds."""
    try:
        body = _DECODER.decode(raw)
    except msgspec.DecodeError as e:  # a ValidationError too
        raise explain(raw, e) from None
    check_request_id(body.request_id)
    check_timeout(body.timeout_s, "timeout_s")
    if isinstance(body.prefill, str):
        check_prefill(body.prefill)
    if isinstance(body.channel, str):
        check_request_id(body.channel, "channel")
    return body


def check_request_id(v: object, field: str = "request_id") -> str:
    """A request's (or a channel's) id: a printable string of 1 to MAX_REQUEST_ID_CHARS
    characters; InvalidParams naming `field` otherwise."""
    if not (isinstance(v, str) and 0 < len(v) <= MAX_REQUEST_ID_CHARS and v.isprintable()):
        raise InvalidParams(
            f"'{field}' must be a printable string of 1 to {MAX_REQUEST_ID_CHARS} "
            f"characters, got {show(v)}",
            field,
        )
    return v


def check_timeout(value: object, field: str) -> float | None:
    """A timeout: None, or a finite number of seconds in (0, MAX_TIMEOUT_S]."""
    if value is None:
        return None
    if not (is_number(value) and 0 < value <= MAX_TIMEOUT_S):
        raise InvalidParams(
            f"'{field}' must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}], got {show(value)}",
            field,
        )
    return float(value)


def check_prefill(v: object) -> str:
    """A prefill worker's control address as the router sends it (protocol/control_address.py)."""
    if not is_control_address(v):
        raise InvalidParams(
            f"'prefill' must be a control address tcp://HOST:PORT (port 1 to 65535), got {show(v)}",
            "prefill",
        )
    return str(v)
