"""What a chat renders to (frontend/chat.py): continue_final_message as HF renders it, tool
calls' arguments as objects, chat_template_kwargs that cannot replace the renderer's own
names, and chat `echo` (vLLM's rules).

Real aiohttp apps in this process, the built-in tiny model's real tokenizer and chat template
(ChatML), a fake engine that keeps the prompt it was sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer

from pdserve.frontend.api import OpenAIApi
from pdserve.model.builtin import trained_tokenizer_json
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.outputs import TokenLogprob
from tests.frontend.fakes import Scripted, call, stream

MAX_LEN = 512
TURNS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "The colour is"},
]


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


def serve(tok: Any, **outputs: Any) -> tuple[OpenAIApi, Scripted]:
    engine = Scripted(4096, MAX_LEN, **outputs)
    return OpenAIApi(engine, tok, "m", MAX_LEN, 5.0), engine


def chat(tok: Any, **body: Any) -> tuple[int, Any, str | None]:
    """(status, answer, the prompt the engine got as text, or None)."""
    api, engine = serve(tok)
    try:
        status, answer = call(api, "POST", "/v1/chat/completions", {"max_tokens": 1, **body})
    finally:
        api.close()
    prompt = tok.decode(engine.prompts[0], skip_special_tokens=False) if engine.prompts else None
    return status, answer, prompt


def test_continue_final_message_leaves_the_last_message_open_as_hf_does(tok, tiny_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    want = hf.apply_chat_template(
        TURNS, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert want.endswith("The colour is")
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    status, answer, prompt = chat(tok, messages=TURNS, **flags)
    assert status == 200, answer
    assert prompt == want
    # continue_final_message alone turns the generation prompt off (vLLM accepts it so)
    assert chat(tok, messages=TURNS, continue_final_message=True)[2] == want
    closed = chat(tok, messages=TURNS, add_generation_prompt=False)[2]
    assert closed is not None and closed == want + "<|im_end|>\n"  # what it was before: closed
    assert len(tok.encode(closed, add_special_tokens=False)) == len(
        tok.encode(want, add_special_tokens=False)
    ) + len(tok.encode("<|im_end|>\n", add_special_tokens=False))


def test_continue_final_message_with_a_generation_prompt_is_vllms_400(tok):
    status, answer, prompt = chat(
        tok, messages=TURNS, continue_final_message=True, add_generation_prompt=True
    )
    assert status == 400 and prompt is None
    err = answer["error"]
    assert err["param"] == "continue_final_message"
    assert "Cannot set both `continue_final_message` and `add_generation_prompt`" in err["message"]
    status, answer, _ = chat(tok, messages=TURNS, continue_final_message="yes")
    assert status == 400 and answer["error"]["param"] == "continue_final_message"


# A template that writes a call's arguments with tojson, as Qwen2.5's does.
TOJSON_TEMPLATE = (
    "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
    "{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"
)


def tool_turns(arguments: Any) -> list[dict[str, Any]]:
    call_ = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call_]},
    ]


def template_tok(template: str) -> Tokenizer:
    return Tokenizer(
        HFTokenizer.from_str(trained_tokenizer_json()), frozenset(), None, {}, template
    )


@pytest.mark.parametrize(
    "arguments,shown",
    [
        ('{"city": "Paris", "days": 2}', '{"city": "Paris", "days": 2}'),
        ({"city": "Paris"}, '{"city": "Paris"}'),
        (None, "{}"),
        ("", "{}"),
    ],
)
def test_tool_call_arguments_reach_the_template_as_an_object(arguments, shown):
    status, answer, prompt = chat(template_tok(TOJSON_TEMPLATE), messages=tool_turns(arguments))
    assert status == 200, answer
    assert prompt == f"<user>weather?<tool_call>{shown}</tool_call>"  # encoded once, not twice


@pytest.mark.parametrize(
    "arguments,words",
    [
        ('{"city": ', "not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        ('"text"', "must hold a JSON object"),
        (5, "must be a JSON object"),
        ("[" * 5000 + "]" * 5000, "nests too deep"),
        ('{"a": "\\ud800"}', "surrogate"),
    ],
)
def test_tool_call_arguments_that_are_no_json_object_are_a_400(arguments, words):
    status, answer, prompt = chat(template_tok(TOJSON_TEMPLATE), messages=tool_turns(arguments))
    assert status == 400 and prompt is None, answer
    err = answer["error"]
    assert err["param"] == "messages" and words in err["message"], err
    assert "tool_calls[0].function.arguments" in err["message"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"messages": []},
        {"add_generation_prompt": False},
        {"continue_final_message": True},
        {"raise_exception": "x"},
        {"namespace": 1},
        {"range": 1},
        {"eos_token": "x"},
    ],
)
def test_chat_template_kwargs_cannot_replace_the_renderers_names(tok, kwargs):
    status, answer, prompt = chat(tok, messages=TURNS[:2], chat_template_kwargs=kwargs)
    assert status == 400 and prompt is None
    assert answer["error"]["param"] == "chat_template_kwargs"


def test_chat_template_kwargs_reach_the_template():
    tok = template_tok("{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}")
    status, answer, prompt = chat(
        tok, messages=TURNS[1:2], chat_template_kwargs={"greeting": "Hello! "}
    )
    assert status == 200 and prompt == "Hello! Name a colour."


def letters(prompt: list[int], params: Any) -> list[tuple[Any, ...]]:
    ids = (1, 2)
    lp = tuple(TokenLogprob(t, -0.5, ()) for t in ids) if params.logprobs is not None else ()
    return [(ids[:1], lp[:1], None, None, len(prompt)), (ids[1:], lp[1:], "length")]


@pytest.mark.parametrize(
    "flags,echoed",
    [
        ({"add_generation_prompt": False}, "The colour is"),  # continues the last role
        ({"continue_final_message": True}, "The colour is"),
        ({}, "The colour is"),  # the answer is the assistant's, as is the last message
    ],
)
def test_chat_echo_starts_the_answer_with_the_last_message(tok, flags, echoed):
    api, _ = serve(tok, outputs=letters)
    body = {"messages": TURNS, "echo": True, "max_tokens": 2, "n": 2, **flags}
    try:
        status, answer = call(api, "POST", "/v1/chat/completions", body)
        chunks = stream(api, "/v1/chat/completions", body)
    finally:
        api.close()
    assert status == 200, answer
    generated = tok.decode([1, 2])
    for c in answer["choices"]:
        assert c["message"]["content"] == echoed + generated
    for i in (0, 1):  # each choice's stream: its role, the echoed text, then what it generates
        deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"][0]["index"] == i]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert deltas[1] == {"content": echoed}
        assert "".join(d.get("content", "") for d in deltas[2:]) == generated


def test_chat_echo_shows_nothing_when_the_last_role_is_not_the_answers(tok):
    api, _ = serve(tok, outputs=letters)
    body = {"messages": TURNS[:2], "echo": True, "max_tokens": 2}
    try:
        status, answer = call(api, "POST", "/v1/chat/completions", body)
        chunks = stream(api, "/v1/chat/completions", body)
    finally:
        api.close()
    assert status == 200 and answer["choices"][0]["message"]["content"] == tok.decode([1, 2])
    assert {"content": "Name a colour."} not in [ch["choices"][0]["delta"] for ch in chunks]
