"""Which OpenAI request fields pdserve honours, which it refuses, and what it does with others.

Every field a client sends is in one of three sets, per endpoint:
- honoured: parsed and acted on (`COMPLETION_FIELDS`, `CHAT_FIELDS`, and vLLM's
  `TOKENIZE_FIELDS`, `DETOKENIZE_FIELDS`; `user` is accepted and has no effect, as its OpenAI
  meaning is only an end-user id for abuse monitoring);
- refused unless it asks for what pdserve does anyway (`refuse_unsupported`): best_of (only
  null, 1 or n), suffix, functions / function_call, audio and modalities (only ["text"]) ->
  400 naming the field; tools, tool_choice and parallel_tool_calls are honoured (see
  frontend/tools.py), and so is structured output (response_format, structured_outputs,
  guided_*: see frontend/structured.py);
- unknown: anything else. Like vLLM, the default is lenient: the field is ignored and logged
  once per field name (a bounded set: a client cannot grow it or flood the log). With
  `--reject-unknown-fields` (serve, router: `reject_unknown_fields(True)`, the process's
  choice) or `strict=True` it is refused with a 400 naming it.

Raises InvalidParams (the caller turns it into its 400); torch-free and I/O-free.
"""

from __future__ import annotations

import logging
from typing import Any

from pdserve.frontend.structured import STRUCTURED_FIELDS
from pdserve.protocol.sampling import InvalidParams, is_int, show

log = logging.getLogger(__name__)

# vLLM's extensions that pdserve implements, in both endpoints.
_EXTENSIONS = frozenset(
    {
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "stop_token_ids",
        "min_tokens",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "timeout",
        "truncate_prompt_tokens",
        "return_tokens_as_token_ids",
        "prompt_logprobs",
        "echo",
    }
)
# Structured output (frontend/structured.py): OpenAI's response_format, vLLM's others.
_EXTENSIONS |= STRUCTURED_FIELDS
_COMMON = frozenset(
    {
        "model",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "n",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "user",
    }
)
# The refused fields are "known" too: refuse_unsupported answers them.
_REFUSED_COMPLETION = frozenset({"best_of", "suffix"})
_REFUSED_CHAT = frozenset(
    {
        "functions",
        "function_call",
        "audio",
        "modalities",
    }
)
COMPLETION_FIELDS = _COMMON | _EXTENSIONS | _REFUSED_COMPLETION | {"prompt"}
CHAT_FIELDS = (
    _COMMON
    | _EXTENSIONS
    | _REFUSED_CHAT
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
        "tools",  # tool use: frontend/tools.py
        "tool_choice",
        "parallel_tool_calls",
    }
)
# vLLM's /tokenize (a prompt, or messages as chat renders them) and /detokenize.
TOKENIZE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "add_special_tokens",
        "return_token_strs",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
        "tools",
    }
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
_KNOWN = {
    "completion": COMPLETION_FIELDS,
    "chat": CHAT_FIELDS,
    "tokenize": TOKENIZE_FIELDS,
    "detokenize": DETOKENIZE_FIELDS,
}

MAX_LOGGED_FIELDS = 256

# The process's choice for unknown fields (serve's and router's --reject-unknown-fields); one
# per process, like the once-per-name log it switches off.
_reject_unknown = False


def reject_unknown_fields(on: bool) -> None:
    """Refuse (True) or log once and ignore (False, the default) unknown request fields, for
    every parse in this process that does not say `strict` itself."""
    global _reject_unknown
    _reject_unknown = on


class _OncePerName:
    """Logs each name's first sighting, for at most MAX_LOGGED_FIELDS names in all."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.full = False

    def warn(self, kind: str, name: str) -> None:
        if name in self.names or self.full:
            return
        if len(self.names) >= MAX_LOGGED_FIELDS:
            self.full = True
            log.warning("more unknown request fields are ignored; no longer logging them")
            return
        self.names.add(name)
        log.warning("ignoring the unknown %s request field %s", kind, show(name))


_unknown_log = _OncePerName()


def _refuse(field: str, why: str) -> InvalidParams:
    return InvalidParams(f"'{field}' is not supported: {why}", field)


def refuse_unsupported(body: dict[str, Any], kind: str) -> None:
    """400 (InvalidParams naming the field) for a field pdserve cannot honour; a value that
    asks for the default behaviour passes."""
    if kind == "completion":
        best_of, n = body.get("best_of"), body.get("n")
        if best_of is not None and not (is_int(best_of) and best_of in (1, 1 if n is None else n)):
            raise _refuse(
                "best_of",
                f"pdserve returns every choice it samples; best_of must be 1 or n, "
                f"got {show(best_of)}",
            )
        if body.get("suffix") not in (None, ""):
            raise _refuse("suffix", "insertion (text after the completion) is not implemented")
        return
    for field in ("functions", "function_call", "audio"):
        if body.get(field) is not None:
            raise _refuse(field, "not implemented")
    if body.get("modalities") not in (None, ["text"]):
        raise _refuse("modalities", 'only ["text"]')


def check_unknown(body: dict[str, Any], kind: str, strict: bool | None = None) -> None:
    """Fields outside the endpoint's set: InvalidParams if `strict` (None: the process's
    choice, `reject_unknown_fields`), else logged once each."""
    known = _KNOWN[kind]
    unknown = sorted(str(k) for k in body if k not in known)
    if not unknown:
        return
    if _reject_unknown if strict is None else strict:
        raise InvalidParams(
            f"unknown field {show(unknown[0])} (this server refuses fields it does not implement)",
            unknown[0],
        )
    for name in unknown:
        _unknown_log.warn(kind, name)
