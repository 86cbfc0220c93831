"""Every OpenAI request field is honoured or refused (issue 14 part 3): refused fields, unknown
fields (lenient: logged once; strict: 400), logit_bias, `logprobs: true`, stream_options,
the seed every request gets, and errors that name the field the client sent."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from pdserve.frontend import fields as openai_fields
from pdserve.frontend.fields import CHAT_FIELDS, COMPLETION_FIELDS, refuse_unsupported
from pdserve.frontend.protocol import ApiError, parse_chat, parse_completion
from pdserve.protocol.sampling import InvalidParams

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
DONE = {"prompt": "x"}


def err(fn: Any, body: Any, **kw: Any) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(body, **kw)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"best_of": 2}, "best_of"),
        ({"best_of": 3, "n": 2}, "best_of"),
        ({"best_of": True}, "best_of"),
        ({"best_of": 1.0}, "best_of"),
        ({"suffix": "tail"}, "suffix"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {}}, "stream_options"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 100.5}}, "logit_bias"),
        ({"logit_bias": {"1": "5"}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": [[1, 2]]}, "logit_bias"),
        ({"logprobs": "1"}, "logprobs"),
        ({"user": 5}, "user"),
    ],
)
def test_completion_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    e = err(parse_completion, {**DONE, **fields})
    assert e.param == param and param in e.message


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": 1},
            "parallel_tool_calls",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.schema",
        ),
        ({"audio": {"voice": "x"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": "3"}, "top_logprobs"),
        ({"max_completion_tokens": 2**40}, "max_completion_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_chat_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    e = err(parse_chat, {**CHAT, **fields})
    assert e.param == param and param in e.message


def test_max_completion_tokens_errors_say_max_completion_tokens() -> None:
    e = err(parse_chat, {**CHAT, "max_completion_tokens": 2**40})
    assert e.message.startswith("max_completion_tokens must be") and "max_tokens" not in (
        e.message.replace("max_completion_tokens", "")
    )


def test_defaults_that_ask_for_nothing_pass() -> None:
    completion = {"best_of": 2, "n": 2, "suffix": "", "stream": True, "stream_options": None}
    assert parse_completion({**DONE, **completion}).n == 2
    assert parse_completion({**DONE, "best_of": 1, "suffix": None}).n == 1
    chat = {
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "functions": None,
        "user": "u-1",
    }
    parse_chat({**CHAT, **chat})
    parse_chat({**CHAT, "tool_choice": "auto"})


GARBAGE = [[{}]]  # no honoured field takes a list of lists of objects


@pytest.mark.parametrize(
    "parse,base,fields",
    [(parse_completion, DONE, COMPLETION_FIELDS), (parse_chat, CHAT, CHAT_FIELDS)],
    ids=["completion", "chat"],
)
def test_every_known_field_is_read_or_refused(parse: Any, base: dict[str, Any], fields: Any):
    for name in sorted(fields):
        e = err(parse, {**base, "stream": True, name: GARBAGE})
        assert e.param == name, (name, e.param)


class Lines(logging.Handler):
    """The messages the openai_fields logger emits, captured on that logger itself (the root
    handlers may carry the process's repeat filter, installed by another test)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def lines() -> Any:
    logger = logging.getLogger("pdserve.frontend.fields")
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_unknown_fields_are_logged_once_each_or_refused_when_strict(
    lines: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(openai_fields, "_unknown_log", openai_fields._OncePerName())
    for _ in range(3):
        parse_completion({**DONE, "service_tier": "auto", "tools": []})
        parse_chat({**CHAT, "service_tier": "auto", "best_of": 2})
    assert lines == [
        "ignoring the unknown completion request field 'service_tier'",
        "ignoring the unknown completion request field 'tools'",
        "ignoring the unknown chat request field 'best_of'",
    ]
    e = err(parse_completion, {**DONE, "service_tier": "auto"}, strict=True)
    assert e.param == "service_tier" and "unknown field 'service_tier'" in e.message
    assert err(parse_chat, {**CHAT, "best_of": 2}, strict=True).param == "best_of"
    parse_chat({**CHAT, "max_completion_tokens": 3}, strict=True)  # known: fine


def test_the_unknown_field_log_is_bounded(lines: list[str]) -> None:
    once = openai_fields._OncePerName()
    for i in range(openai_fields.MAX_LOGGED_FIELDS + 50):
        once.warn("chat", f"f{i}")
    assert len(lines) == openai_fields.MAX_LOGGED_FIELDS + 1
    assert "no longer logging" in lines[-1]


def test_refuse_unsupported_raises_invalid_params() -> None:
    with pytest.raises(InvalidParams) as e:
        refuse_unsupported({"suffix": "x"}, "completion")
    assert e.value.param == "suffix"


def test_logit_bias_becomes_sorted_pairs() -> None:
    p = parse_completion({**DONE, "logit_bias": {"50": 5, "7": -100, "0": 0.5}}).params
    assert p.logit_bias == ((0, 0.5), (7, -100), (50, 5))
    assert parse_chat({**CHAT, "logit_bias": {}}).params.logit_bias == ()


def test_completions_logprobs_true_is_one_and_false_is_none() -> None:
    assert parse_completion({**DONE, "logprobs": True}).params.logprobs == 1
    assert parse_completion({**DONE, "logprobs": False}).params.logprobs is None
    assert parse_completion({**DONE, "logprobs": 0}).params.logprobs == 0
    assert parse_completion({**DONE, "logprobs": 5}).params.logprobs == 5
    assert err(parse_completion, {**DONE, "logprobs": 21}).param == "logprobs"


def test_every_request_gets_a_seed_and_a_given_one_is_kept() -> None:
    seeds = {parse_completion(DONE).params.seed for _ in range(8)}
    assert None not in seeds and len(seeds) == 8
    assert all(0 <= s < 2**63 for s in seeds if s is not None)
    assert parse_chat({**CHAT, "seed": -3}).params.seed == -3


def test_include_stop_str_in_output_reaches_the_params() -> None:
    spec = parse_completion({**DONE, "include_stop_str_in_output": True})
    assert spec.params.include_stop_str_in_output and spec.include_stop_str
    assert not parse_chat(CHAT).params.include_stop_str_in_output
