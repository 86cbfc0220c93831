"""A worker's /generate body -> its checked fields, refusing anything wrong with a 400 naming
the field (docs/architecture.md §Request flow, step 1).

Two decoders give one answer. The general one is every JSON endpoint's (`parse_json_body`:
Python's json, then a walk for depth and lone surrogates) followed by a check per field; it
looks at each prompt id in Python, three times over. The fast one decodes the body with msgspec
into a typed struct, which checks the ids' types in C, then runs the same field checks. It
accepts only what the general one accepts (a typed field takes a subset of what the general
check does; msgspec refuses a lone surrogate and bytes that are not UTF-8, as the general
decoder does), and anything it refuses, for any reason, goes to the general decoder, which
names the fault: one message per fault, however the body arrived. The fast path costs the
worker's event loop, which shares the GIL with the engine thread, a fraction of the general
one's time (`python benchmarks/generate_body.py`; benchmarks/RESULTS.md, 2026-12-05).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from pdserve.frontend.protocol import bad, check_timeout
from pdserve.protocol.control_address import is_control_address
from pdserve.protocol.sampling import InvalidParams, SamplingParams, is_int, show
from pdserve.server.api_error import ApiError
from pdserve.server.json_body import parse_json_body

MAX_REQUEST_ID_CHARS = 256
GENERATE_KEYS = frozenset({"request_id", "prompt_ids", "params", "timeout_s", "prefill", "channel"})

# The engine's own check of a prompt and its params (Engine.validate): InvalidParams if never
# servable.
Validate = Callable[[list[int], SamplingParams], None]


@dataclass(frozen=True)
class Generate:
    """A /generate body whose every field is checked."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    timeout_s: float | None
    prefill: str | None  # P's control address; None: this worker prefills
    channel: str | None  # the router's output channel; None: the answer streams the outputs


def parse_generate(raw: bytes, charset: str | None, validate: Validate) -> Generate:
    """The body's fields; ApiError 400 naming the field on anything wrong."""
    fast = _fast(raw, charset, validate)
    return fast if fast is not None else _general(parse_json_body(raw, charset), validate)


def params_from_json(d: Any) -> SamplingParams:
    """A router's or a peer's params -> SamplingParams (`SamplingParams.from_builtins`);
    anything wrong is ApiError 400 naming the field, and nothing else is raised."""
    try:
        return SamplingParams.from_builtins(d)
    except InvalidParams as e:
        raise bad(str(e), e.param) from e


def check_request_id(v: Any, field: str = "request_id") -> str:
    """A request's (or a channel's) id: a printable string of 1 to 256 characters."""
    if not (isinstance(v, str) and 0 < len(v) <= MAX_REQUEST_ID_CHARS and v.isprintable()):
        raise bad(
            f"'{field}' must be a printable string of 1 to {MAX_REQUEST_ID_CHARS} "
            f"characters, got {show(v)}",
            field,
        )
    return v


def check_prefill_address(v: Any) -> str:
    """A prefill worker's control address as the router sends it (protocol/control_address.py)."""
    if not is_control_address(v):
        raise bad(
            f"'prefill' must be a control address tcp://HOST:PORT (port 1 to 65535), got {show(v)}",
            "prefill",
        )
    return str(v)


def _general(body: Any, validate: Validate) -> Generate:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in GENERATE_KEYS)
    if unknown:
        raise bad(f"unknown fields {show(unknown)}", unknown[0])
    rid = check_request_id(body.get("request_id"))
    prompt = body.get("prompt_ids")
    if not isinstance(prompt, list) or not all(is_int(t) for t in prompt):
        raise bad("'prompt_ids' must be a list of integers", "prompt_ids")
    params = params_from_json(body.get("params", {}))
    timeout = check_timeout(body.get("timeout_s"), "timeout_s")
    prefill = check_prefill_address(body["prefill"]) if "prefill" in body else None
    cid = check_request_id(body["channel"], "channel") if "channel" in body else None
    try:
        validate(prompt, params)
    except InvalidParams as e:
        raise bad(str(e), e.param) from e
    return Generate(rid, prompt, params, timeout, prefill, cid)


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    """The typed form: each field takes a subset of what `_general` takes for it (an absent
    `prefill` or `channel` is UNSET, so an explicit null goes to `_general`, which refuses it)."""

    request_id: str
    prompt_ids: list[int]  # a bool or a float is refused, as is_int refuses them
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    timeout_s: float | None = None
    prefill: str | msgspec.UnsetType = msgspec.UNSET
    channel: str | msgspec.UnsetType = msgspec.UNSET


_DECODER = msgspec.json.Decoder(_Body)


def _fast(raw: bytes, charset: str | None, validate: Validate) -> Generate | None:
    """The body's fields if the typed decoder and every check take it, else None."""
    if not _is_utf8(charset):
        return None  # parse_json_body decodes other charsets, and names the ones it cannot
    try:
        b = _DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):  # also InvalidParams, as its cause
        return None
    prefill = b.prefill if isinstance(b.prefill, str) else None
    channel = b.channel if isinstance(b.channel, str) else None
    try:
        rid = check_request_id(b.request_id)
        timeout = check_timeout(b.timeout_s, "timeout_s")
        if prefill is not None:
            check_prefill_address(prefill)
        if channel is not None:
            check_request_id(channel, "channel")
        validate(b.prompt_ids, b.params)
    except (ApiError, InvalidParams):
        return None
    return Generate(rid, b.prompt_ids, b.params, timeout, prefill, channel)


def _is_utf8(charset: str | None) -> bool:
    """Whether a Content-Type charset names UTF-8 ("utf-8", "UTF8", ...; none: JSON's own)."""
    if charset is None:
        return True
    try:
        return codecs.lookup(charset).name == "utf-8"
    except LookupError:
        return False
