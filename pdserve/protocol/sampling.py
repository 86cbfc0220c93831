"""SamplingParams: how one request's tokens are chosen and when it stops (token level).

Validation lives here, once, so every entry point (the OpenAI API of a worker or of the
router, the worker API, a peer's PrefillRequest) refuses the same bad input with the same
message. Every field is checked for type, range and finiteness in `__post_init__`, which
runs on construction, on `replace` and on `from_builtins`, because the values go on to
msgpack, torch tensors and torch.Generator, which fail deep inside an engine thread on what
Python itself accepts (a 70-bit int, NaN, a string seed). Ints are compared exactly and never
pass through float(), which raises OverflowError past 1e308.

On the wire (the worker API's JSON body, the control plane's PrefillRequest) the params are
the struct's builtins form: `to_builtins()` out, `SamplingParams.from_builtins()` back in,
which raises InvalidParams naming the field and nothing else, whatever the peer sent.

Float fields may hold an int (JSON `1` for 1.0); the type system's float accepts it too.
Stop *strings* are text and are handled where text exists (the API layer); the engine only
knows token ids. `include_stop_str_in_output` (vLLM's name) travels with the params for that
layer: whether the text of a stop string or stop token stays in the output. `logit_bias` is
OpenAI's map of token id -> bias in [-100, 100], held as (id, bias) pairs in increasing id
order (a frozen struct needs a hashable field; one order makes equal maps equal).
`validate_prompt` adds the checks that need the model's limits (token ids < vocab).
`constraint` is structured output (protocol/constraint.py): a typed struct checked, and its
grammar compiled, when it is built, so it is refused here like any other field.

Sans-I/O and torch-free: the router imports this module.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, TypeGuard

import msgspec

from pdserve.protocol.constraint import Constraint
from pdserve.protocol.invalid_params import InvalidParams as InvalidParams  # re-exported
from pdserve.protocol.invalid_params import is_int as is_int  # re-exported
from pdserve.protocol.invalid_params import show as show  # re-exported

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# torch.Generator.manual_seed takes [-2**63, 2**64 - 1], and msgpack encodes up to 2**64 - 1.
# The OpenAI API takes an int64 seed; choice i of n gets seed + i, which stays in this range.
SEED_MIN, SEED_MAX = INT64_MIN, 2**64 - 1
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries in one logit_bias map (OpenAI's limit)
LOGIT_BIAS_LIMIT = 100.0  # each bias is in [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]
# A temperature below this is greedy, as in vLLM: logits / 1e-40 overflow to inf, and the
# softmax of a row holding several infs is NaN, which torch.multinomial refuses.
GREEDY_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


def is_number(v: object) -> TypeGuard[int | float]:
    """An int or a finite float; not a bool, not NaN, not +-Infinity."""
    if isinstance(v, bool):
        return False
    return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v))


def _int(name: str, v: object, lo: int, hi: int, note: str = "") -> None:
    if not (is_int(v) and lo <= v <= hi):
        raise InvalidParams(f"{name} must be an integer in [{lo}, {hi}]{note}, got {show(v)}", name)


def _number(name: str, v: object, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = is_number(v) and (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise InvalidParams(f"{name} must be a finite number in {span}, got {show(v)}", name)


_MAX_TOKENS_NOTE = {0: "", 1: " (0 only with prompt_logprobs)"}


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_TEMPERATURE = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives to return per token
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids increasing
    include_stop_str_in_output: bool = False
    # Score the prompt: each prompt token after the first gets its logprob and this many top
    # alternatives (vLLM's name). With it, max_tokens may be 0: the prompt only is computed.
    prompt_logprobs: int | None = None
    # Structured output: what the output must match (protocol/constraint.py); checked, the
    # grammar compiled once, when the Constraint is built.
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        lowest = 0 if self.prompt_logprobs is not None else 1
        _int("max_tokens", self.max_tokens, lowest, INT32_MAX, _MAX_TOKENS_NOTE[lowest])
        _number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _int("top_k", self.top_k, 0, INT32_MAX, " (0 disables it)")
        _number("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _int("seed", self.seed, SEED_MIN, SEED_MAX)
        _number(
            "repetition_penalty",
            self.repetition_penalty,
            MIN_REPETITION_PENALTY,
            MAX_REPETITION_PENALTY,
        )
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParams(
                f"ignore_eos must be true or false, got {show(self.ignore_eos)}", "ignore_eos"
            )
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParams(
                f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids, "
                f"got {show(ids)}",
                "stop_token_ids",
            )
        for t in ids:
            _int("stop_token_ids", t, 0, INT64_MAX)
        _int("min_tokens", self.min_tokens, 0, self.max_tokens, " (at most max_tokens)")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _check_logit_bias(self.logit_bias)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InvalidParams(
                "include_stop_str_in_output must be true or false, got "
                f"{show(self.include_stop_str_in_output)}",
                "include_stop_str_in_output",
            )
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InvalidParams(
                f"constraint must be an object {{kind, spec}}, got {show(self.constraint)}",
                "constraint",
            )

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with `changes`, validated like a new one (InvalidParams)."""
        return msgspec.structs.replace(self, **changes)

    def to_builtins(self) -> dict[str, Any]:
        """The wire form: a dict of every field, ready for JSON or msgpack."""
        d: dict[str, Any] = msgspec.to_builtins(self)
        return d

    @classmethod
    def from_builtins(cls, d: object) -> SamplingParams:
        """The wire form back; InvalidParams naming the field on anything wrong, never
        another exception, whatever `d` holds (it comes from a client or a peer)."""
        if not isinstance(d, dict):
            raise InvalidParams(f"'params' must be an object, got {show(d)}", "params")
        unknown = [k for k in d if k not in cls.__struct_fields__]
        if unknown:
            raise InvalidParams(
                f"unknown sampling params {show(sorted(map(str, unknown)))}", "params"
            )
        wrong_type: Exception
        try:
            return msgspec.convert(d, cls)
        except msgspec.ValidationError as e:
            if isinstance(e.__cause__, InvalidParams):  # raised by __post_init__
                raise e.__cause__ from None
            wrong_type = e
        except UnicodeEncodeError as e:  # a lone surrogate where no string belongs
            wrong_type = e
        # msgspec refused a field's type before our checks ran: run them for the usual message.
        kw = dict(d)
        ids = d.get("stop_token_ids")
        if isinstance(ids, list):
            kw["stop_token_ids"] = tuple(ids)
        bias = d.get("logit_bias")
        if isinstance(bias, list):
            kw["logit_bias"] = tuple(tuple(e) if isinstance(e, list) else e for e in bias)
        if isinstance(d.get("constraint"), dict):
            kw["constraint"] = Constraint.from_builtins(d["constraint"])
        try:
            cls(**kw)
        except InvalidParams:
            raise
        except (TypeError, ValueError, OverflowError) as e:  # a gap in __post_init__'s checks
            raise InvalidParams(f"bad sampling params: {e}", "params") from None
        where = re.search(r"at `\$\.(\w+)", str(wrong_type))
        field = where[1] if where and where[1] in cls.__struct_fields__ else "params"
        raise InvalidParams(f"bad sampling params: {wrong_type}", field) from None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def needs_filtering(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _check_logit_bias(bias: object) -> None:
    if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS:
        raise InvalidParams(
            f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases, got {show(bias)}",
            "logit_bias",
        )
    last = -1
    for entry in bias:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise InvalidParams(
                f"logit_bias entries must be (token id, bias) pairs, got {show(entry)}",
                "logit_bias",
            )
        token, value = entry
        if not (is_int(token) and last < token <= INT32_MAX):
            raise InvalidParams(
                f"logit_bias token ids must be integers in [0, {INT32_MAX}], each once and in "
                f"increasing order, got {show(token)}",
                "logit_bias",
            )
        if not (is_number(value) and -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT):
            raise InvalidParams(
                f"logit_bias values must be numbers in [-{LOGIT_BIAS_LIMIT:g}, "
                f"{LOGIT_BIAS_LIMIT:g}], got {show(value)} for token {token}",
                "logit_bias",
            )
        last = token


def validate_prompt(
    prompt_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """Raise InvalidParams for a request a model with these limits can never serve.

    The one rule set of Engine.validate and of the router (which must refuse exactly what a
    worker would, with the same message: the router tests compare the 400 bodies).
    """
    if not prompt_ids:
        raise InvalidParams("the prompt is empty", "prompt")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise InvalidParams(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if len(prompt_ids) >= max_model_len:
        raise InvalidParams(
            f"the prompt has {len(prompt_ids)} tokens; this model's context is "
            f"{max_model_len} tokens, including at least one generated token",
            "prompt",
        )
    if len(prompt_ids) + params.max_tokens > max_model_len:
        raise InvalidParams(
            f"max_tokens {params.max_tokens} + {len(prompt_ids)} prompt tokens exceeds the "
            f"context of {max_model_len} tokens",
            "max_tokens",
        )
    outside = [t for t in params.stop_token_ids if t >= vocab_size]
    if outside:
        raise InvalidParams(
            f"stop_token_ids must be in [0, {vocab_size}), got {show(outside[0])}",
            "stop_token_ids",
        )
    biased = [t for t, _ in params.logit_bias if t >= vocab_size]
    if biased:
        raise InvalidParams(
            f"logit_bias token ids must be in [0, {vocab_size}), got {show(biased[0])}",
            "logit_bias",
        )
