"""OpenAI request bodies -> a validated GenerationSpec; errors -> OpenAI-style bodies.

Everything a client can get wrong is caught here and reported as an ApiError with the HTTP
status and the offending parameter, before anything reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.params import InvalidParams, SamplingParams


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


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
    chat_kwargs: dict[str, Any] = field(default_factory=dict)


_MISSING = object()


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
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
        return tuple(stop)
    raise bad("'stop' must be a string or a list of at most 16 strings", "stop")


def _params(body: dict[str, Any], max_tokens: int, logprobs: int | None) -> SamplingParams:
    stop_ids = _get(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise bad("'stop_token_ids' must be a list of integers", "stop_token_ids")
    num = (int, float)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(_get(body, "temperature", num, 1.0)),
            top_p=float(_get(body, "top_p", num, 1.0)),
            top_k=max(0, int(_get(body, "top_k", int, 0))),  # vLLM accepts -1 for "off"
            min_p=float(_get(body, "min_p", num, 0.0)),
            seed=_get(body, "seed", int, None),
            repetition_penalty=float(_get(body, "repetition_penalty", num, 1.0)),
            frequency_penalty=float(_get(body, "frequency_penalty", num, 0.0)),
            presence_penalty=float(_get(body, "presence_penalty", num, 0.0)),
            ignore_eos=_get(body, "ignore_eos", bool, False),
            stop_token_ids=tuple(stop_ids),
            min_tokens=_get(body, "min_tokens", int, 0),
            logprobs=logprobs,
        )
    except InvalidParams as e:
        raise bad(str(e), e.param) from e


def _common(body: dict[str, Any]) -> dict[str, Any]:
    n = _get(body, "n", int, 1)
    if not 1 <= n <= 16:
        raise bad(f"'n' must be in [1, 16], got {n}", "n")
    stream_options = _get(body, "stream_options", dict, {})
    timeout = _get(body, "timeout", (int, float), None)
    return {
        "n": n,
        "stream": _get(body, "stream", bool, False),
        "include_usage": bool(stream_options.get("include_usage", False)),
        "stop": _stop(body),
        "include_stop_str": _get(body, "include_stop_str_in_output", bool, False),
        "skip_special_tokens": _get(body, "skip_special_tokens", bool, True),
        "timeout_s": float(timeout) if timeout is not None else None,
    }


def _max_tokens(body: dict[str, Any], *names: str) -> tuple[int, bool]:
    for name in names:
        v = _get(body, name, int, None)
        if v is not None:
            if v < 1:
                raise bad(f"'{name}' must be >= 1, got {v}", name)
            return v, True
    return 16, False


def parse_completion(body: Any) -> GenerationSpec:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = _get(body, "model", str, "")
    prompt = body.get("prompt")
    prompts: list[str | tuple[int, ...]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [tuple(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt)
    ):
        prompts = [tuple(p) for p in prompt]
    else:
        raise bad(
            "'prompt' must be a non-empty string, list of strings, or token id list(s)", "prompt"
        )
    if any(p == "" for p in prompts):
        raise bad("'prompt' must not be empty", "prompt")
    max_tokens, given = _max_tokens(body, "max_tokens")
    logprobs = _get(body, "logprobs", int, None)
    return GenerationSpec(
        kind="completion",
        model=model,
        prompts=tuple(prompts),
        params=_params(body, max_tokens, logprobs),
        max_tokens_given=given,
        echo=_get(body, "echo", bool, False),
        **_common(body),
    )


def parse_chat(body: Any) -> GenerationSpec:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = _get(body, "model", str, "")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    norm = tuple(_message(m, i) for i, m in enumerate(messages))
    max_tokens, given = _max_tokens(body, "max_completion_tokens", "max_tokens")
    top = _get(body, "top_logprobs", int, None)
    logprobs = (top or 0) if _get(body, "logprobs", bool, False) else None
    if top is not None and logprobs is None:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    kwargs = _get(body, "chat_template_kwargs", dict, {})
    return GenerationSpec(
        kind="chat",
        model=model,
        prompts=(),
        params=_params(body, max_tokens, logprobs),
        max_tokens_given=given,
        messages=norm,
        chat_kwargs={
            "add_generation_prompt": _get(body, "add_generation_prompt", bool, True),
            **kwargs,
        },
        **_common(body),
    )


def _message(m: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object", "messages")
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise bad(f"{where}.role must be system, user, assistant or tool, got {role!r}", "messages")
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise bad(f"{where}.content: only text parts are supported", "messages")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise bad(f"{where}.content must be a string or a list of text parts", "messages")
    return {
        **{k: v for k, v in m.items() if k != "content"},
        "role": "system" if role == "developer" else role,
        "content": content,
    }


def _is_int(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)
