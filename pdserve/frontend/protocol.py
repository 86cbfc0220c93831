"""OpenAI request bodies -> a validated GenerationSpec; errors -> OpenAI-style bodies.

Everything a client can get wrong is caught here and reported as an ApiError with the HTTP
status and the offending parameter, before anything reaches the engine: the body's bytes
(charset, JSON, nesting depth, lone surrogates: `parse_json_body`, shared with the worker
API), then which fields it may hold (`fields.py`: honoured, refused, or unknown: logged,
or refused when `strict`), then every field's type and range (sampling fields through
SamplingParams), then the limits on how much one body may ask for (prompts x n, stop
strings). An error names the field as the client sent it (`max_completion_tokens`,
`top_logprobs`), not the SamplingParams field it feeds. One check is left to the API:
whether an output constraint compiles, which waits on the grammar thread, so it is built off
the event loop (frontend/constraint_threads.py) before the request is served.

Every SamplingParams built here has a seed: the client's, or one drawn here. The random
stream of a request is a function of (seed, output position) (engine/sampling/), so a
request sampled by a prefill and a decode worker draws the same tokens as co-located; choice
i of n gets seed + i (frontend/generation.py).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from pdserve.frontend.chat import RESERVED_TEMPLATE_NAMES as RESERVED_TEMPLATE_NAMES  # re-exported
from pdserve.frontend.chat import parse_chat_prompt
from pdserve.frontend.fields import check_unknown, refuse_unsupported
from pdserve.frontend.structured import AskedConstraint, find_constraint
from pdserve.frontend.tools import NO_TOOLS, ToolRequest, parse_tools
from pdserve.protocol.generate import check_timeout
from pdserve.protocol.sampling import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    InvalidParams,
    SamplingParams,
    is_int,
    show,
)
from pdserve.server.api_error import ApiError as ApiError  # re-exported
from pdserve.server.api_error import bad
from pdserve.server.json_body import MAX_JSON_DEPTH as MAX_JSON_DEPTH  # re-exported
from pdserve.server.json_body import check_json as check_json  # re-exported
from pdserve.server.json_body import parse_json_body as parse_json_body  # re-exported

MAX_N = 16
MAX_PROMPTS = 256  # prompts in one completions body
MAX_CHOICES = 256  # prompts x n: the requests one body may start
MAX_STOPS = 16
MAX_STOP_CHARS = 1000


@dataclass(frozen=True)
class GenerationSpec:
    """One API call: prompts (text or ids) x n choices, all with the same sampling."""

    kind: str  # "completion" | "chat"
    model: str
    prompts: tuple[str | tuple[int, ...], ...]
    params: SamplingParams
    max_tokens_given: bool
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()
    include_stop_str: bool = False
    echo: bool = False
    skip_special_tokens: bool = True
    timeout_s: float | None = None
    messages: tuple[dict[str, Any], ...] = ()
    chat_kwargs: dict[str, Any] = field(default_factory=dict)  # apply_chat_template's
    chat_template: str | None = None  # the client's own (frontend/chat.py); None: the model's
    echo_text: str = ""  # chat `echo`: shown before each choice's completion
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens (-1: the context)
    token_ids_as_text: bool = False  # return_tokens_as_token_ids: tokens shown as "token_id:N"
    prompt_logprobs: int | None = None  # the prompt's scores the client asked to be shown
    tools: ToolRequest = NO_TOOLS  # chat's tools and tool choice (frontend/tools.py)
    # The output constraint, not yet compiled: the API builds it into `params` off the event
    # loop (frontend/constraint_threads.py), after tool_use.py may have replaced it.
    constraint: AskedConstraint | None = None


_MISSING = object()


def _timeout(value: Any) -> float | None:
    """A client's `timeout`: None, or seconds in (0, MAX_TIMEOUT_S] (/generate's rule)."""
    try:
        return check_timeout(value, "timeout")
    except InvalidParams as e:
        raise bad(str(e), e.param) from e


def _get(body: dict[str, Any], name: str, types: type | tuple[type, ...], default: Any) -> Any:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in _as_tuple(types))
    if not ok:
        want = " or ".join(t.__name__ for t in _as_tuple(types))
        raise bad(f"'{name}' must be {want}, got {type(v).__name__}", name)
    return v


def _as_tuple(t: type | tuple[type, ...]) -> tuple[type, ...]:
    return t if isinstance(t, tuple) else (t,)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        isinstance(stops, list)
        and len(stops) <= MAX_STOPS
        and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        return tuple(stops)
    raise bad(
        f"'stop' must be a string or a list of at most {MAX_STOPS} strings, "
        f"each of 1 to {MAX_STOP_CHARS} characters",
        "stop",
    )


def _params(
    body: dict[str, Any],
    max_tokens: int,
    logprobs: int | None,
    names: dict[str, str],
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The body's SamplingParams; `names` maps a SamplingParams field to the body field that
    fed it where they differ, for the error's wording and param."""
    # Range, type and finiteness of each field are SamplingParams' checks; numbers go in as
    # the client sent them (float() of a 400-digit int would raise OverflowError).
    seed = _get(body, "seed", int, None)
    if seed is None:
        seed = secrets.randbits(63)  # choice i of n adds i: still inside SEED_MAX
    elif not INT64_MIN <= seed <= INT64_MAX:
        raise bad(
            f"'seed' must be an integer in [{INT64_MIN}, {INT64_MAX}], got {show(seed)}", "seed"
        )
    top_k = _get(body, "top_k", int, 0)
    num = (int, float)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_get(body, "temperature", num, 1.0),
            top_p=_get(body, "top_p", num, 1.0),
            top_k=0 if top_k == -1 else top_k,  # vLLM accepts -1 for "off"
            min_p=_get(body, "min_p", num, 0.0),
            seed=seed,
            repetition_penalty=_get(body, "repetition_penalty", num, 1.0),
            frequency_penalty=_get(body, "frequency_penalty", num, 0.0),
            presence_penalty=_get(body, "presence_penalty", num, 0.0),
            ignore_eos=_get(body, "ignore_eos", bool, False),
            stop_token_ids=tuple(_get(body, "stop_token_ids", list, [])),
            min_tokens=_get(body, "min_tokens", int, 0),
            logprobs=logprobs,
            logit_bias=_logit_bias(body),
            include_stop_str_in_output=_get(body, "include_stop_str_in_output", bool, False),
            prompt_logprobs=prompt_logprobs,
        )
    except InvalidParams as e:
        message, field = str(e), e.param
        if field is not None and field in names:  # name the field the client sent
            if message.startswith(field):
                message = names[field] + message[len(field) :]
            field = names[field]
        raise bad(message, field) from e


def _constraint(body: dict[str, Any]) -> AskedConstraint | None:
    """The body's output constraint (structured output: frontend/structured.py), its fields
    checked; whether it compiles is checked as it is built, off the event loop."""
    try:
        return find_constraint(body)
    except InvalidParams as e:
        raise bad(str(e), e.param) from e


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} -> sorted (id, bias) pairs; the ranges are SamplingParams'."""
    bias = _get(body, "logit_bias", dict, {})
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad(
            f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", "logit_bias"
        )
    pairs = []
    for k, v in bias.items():
        token = k if is_int(k) else _token_key(k)
        if token is None:
            raise bad(
                f"'logit_bias' keys must be token ids (decimal integers), got {show(k)}",
                "logit_bias",
            )
        pairs.append((token, v))
    return tuple(sorted(pairs, key=lambda p: p[0]))


def _token_key(k: object) -> int | None:
    """A JSON object key holding a token id ("50256"), else None."""
    if isinstance(k, str) and 0 < len(k) <= 10 and k.isascii() and k.isdigit():
        return int(k)
    return None


def _common(body: dict[str, Any], num_prompts: int) -> dict[str, Any]:
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise bad(f"'n' must be in [1, {MAX_N}], got {show(n)}", "n")
    if n * num_prompts > MAX_CHOICES:
        raise bad(
            f"'n' x the number of prompts must be at most {MAX_CHOICES}, got {n} x {num_prompts}",
            "n",
        )
    _get(body, "user", str, None)  # accepted, no effect: OpenAI's end-user id for monitoring
    stream = _get(body, "stream", bool, False)
    stream_options = _get(body, "stream_options", dict, {})
    if body.get("stream_options") is not None and not stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    include_usage = stream_options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise bad("'stream_options.include_usage' must be true or false", "stream_options")
    return {
        "n": n,
        "stream": stream,
        "include_usage": bool(include_usage),
        "stop": _stop(body),
        "include_stop_str": _get(body, "include_stop_str_in_output", bool, False),
        "skip_special_tokens": _get(body, "skip_special_tokens", bool, True),
        "timeout_s": _timeout(body.get("timeout")),
        "truncate_prompt_tokens": _truncate(body),
        "token_ids_as_text": _get(body, "return_tokens_as_token_ids", bool, False),
    }


def _truncate(body: dict[str, Any]) -> int | None:
    """vLLM's truncate_prompt_tokens: keep the prompt's last k tokens; -1: the context's
    length (its bound by the context is the endpoint's check)."""
    k: int | None = _get(body, "truncate_prompt_tokens", int, None)
    if k is not None and k != -1 and k < 1:
        raise bad(
            f"'truncate_prompt_tokens' must be -1 (the model's context) or >= 1, got {show(k)}",
            "truncate_prompt_tokens",
        )
    return k


def _shown_prompt_logprobs(body: dict[str, Any]) -> int | None:
    """vLLM's prompt_logprobs: each prompt token's logprob and this many alternatives."""
    n: int | None = _get(body, "prompt_logprobs", int, None)
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise bad(
            f"'prompt_logprobs' must be in [0, {MAX_LOGPROBS}], got {show(n)}", "prompt_logprobs"
        )
    if n is not None and body.get("stream") is True:
        raise bad("'prompt_logprobs' is not available with 'stream': true", "prompt_logprobs")
    return n


def _max_tokens(body: dict[str, Any], *names: str, echo: bool = False) -> tuple[int, bool, str]:
    """(max tokens, whether the body gave it, the name it came by); 0 only with `echo`
    (completions: score the prompt, generate nothing)."""
    lowest = 0 if echo else 1
    for name in names:
        v = _get(body, name, int, None)
        if v is not None:
            if v < lowest:
                note = "" if echo else " (0 only with 'echo')"
                raise bad(f"'{name}' must be >= {lowest}{note}, got {show(v)}", name)
            return v, True, name
    return 16, False, names[0]


def _fields(body: Any, kind: str, strict: bool | None) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    try:
        check_unknown(body, kind, strict)
        refuse_unsupported(body, kind)
    except InvalidParams as e:
        raise bad(str(e), e.param) from e
    return body


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    """Completions' `logprobs` is a count of alternatives; as in vLLM (whose int field takes
    JSON true as 1), `true` asks for 1; `false` asks for none (vLLM would read 0)."""
    v = body.get("logprobs")
    if isinstance(v, bool):
        return 1 if v else None
    n: int | None = _get(body, "logprobs", int, None)
    return n


def parse_completion(body: Any, strict: bool | None = None) -> GenerationSpec:
    """A /v1/completions body -> its GenerationSpec; `strict` refuses unknown fields (None:
    as the process chose, fields.reject_unknown_fields)."""
    body = _fields(body, "completion", strict)
    model = _get(body, "model", str, "")
    prompt = body.get("prompt")
    prompts: list[str | tuple[int, ...]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        prompts = [tuple(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in prompt)
    ):
        prompts = [tuple(p) for p in prompt]
    else:
        raise bad(
            "'prompt' must be a non-empty string, list of strings, or token id list(s)", "prompt"
        )
    if any(p == "" for p in prompts):
        raise bad("'prompt' must not be empty", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise bad(f"'prompt' may hold at most {MAX_PROMPTS} prompts, got {len(prompts)}", "prompt")
    echo = _get(body, "echo", bool, False)
    max_tokens, given, _ = _max_tokens(body, "max_tokens", echo=echo)
    logprobs = _completion_logprobs(body)
    # echo + logprobs scores the echoed prompt too, as vLLM; max_tokens 0 needs it scored.
    shown = _shown_prompt_logprobs(body)
    prompt_logprobs = logprobs if echo and logprobs is not None else None
    if shown is not None:
        prompt_logprobs = max(prompt_logprobs or 0, shown)
    if max_tokens == 0 and prompt_logprobs is None:
        prompt_logprobs = 0
    return GenerationSpec(
        kind="completion",
        model=model,
        prompts=tuple(prompts),
        params=_params(body, max_tokens, logprobs, {}, prompt_logprobs),
        constraint=_constraint(body),
        max_tokens_given=given,
        echo=echo,
        prompt_logprobs=shown,
        **_common(body, len(prompts)),
    )


def parse_chat(body: Any, strict: bool | None = None) -> GenerationSpec:
    """A /v1/chat/completions body -> its GenerationSpec; `strict` as in parse_completion."""
    body = _fields(body, "chat", strict)
    try:
        tools = parse_tools(body)  # the template's `tools`, and what is asked of them
    except InvalidParams as e:
        raise bad(str(e), e.param) from e
    model = _get(body, "model", str, "")
    prompt = parse_chat_prompt(body, tools.tools)  # messages, template, flags: frontend/chat.py
    max_tokens, given, max_name = _max_tokens(body, "max_completion_tokens", "max_tokens")
    top = _get(body, "top_logprobs", int, None)
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {show(top)}", "top_logprobs")
    logprobs = (top or 0) if _get(body, "logprobs", bool, False) else None
    if top is not None and logprobs is None:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    shown = _shown_prompt_logprobs(body)
    return GenerationSpec(
        kind="chat",
        model=model,
        prompts=(),
        params=_params(
            body,
            max_tokens,
            logprobs,
            {"max_tokens": max_name, "logprobs": "top_logprobs"},
            shown,
        ),
        constraint=_constraint(body),
        max_tokens_given=given,
        messages=prompt.messages,
        chat_kwargs=prompt.kwargs,
        chat_template=prompt.template,
        echo_text=prompt.echo,
        prompt_logprobs=shown,
        tools=tools,
        **_common(body, 1),
    )
