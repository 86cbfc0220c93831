"""vLLM's /tokenize, /detokenize and /version (frontend/tokenization.py, frontend/api.py), in
its request and response shapes; bad input is a 400 naming the field.

Real aiohttp apps in this process, the tiny model's real tokenizer and chat template."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from pdserve.frontend.api import VERSION, OpenAIApi
from pdserve.model.tokenizer import Tokenizer
from tests.frontend.fakes import Scripted, call

MAX_LEN = 64
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


def send(tok: Tokenizer, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    api = OpenAIApi(Scripted(4096, MAX_LEN), tok, "tiny", MAX_LEN, 5.0, max_prompt_chars=100)
    try:
        return call(api, method, path, body)
    finally:
        api.close()


def test_tokenize_a_prompt(tok):
    status, got = send(tok, "POST", "/tokenize", {"model": "tiny", "prompt": "hello world"})
    ids = tok.encode("hello world")
    assert status == 200
    assert got == {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids, "token_strs": None}
    body = {"prompt": "hello world", "add_special_tokens": False, "return_token_strs": True}
    status, got = send(tok, "POST", "/tokenize", body)
    plain = tok.encode("hello world", add_special_tokens=False)
    assert got["tokens"] == plain and got["token_strs"] == [tok.token_piece(t) for t in plain]
    assert "Ġworld" in got["token_strs"]  # the vocabulary's spelling, as HF's convert_ids_to_tokens


def test_tokenize_counts_a_text_longer_than_the_context(tok):
    text = "word " * 500  # past the context and the character bound: counting is the point
    status, got = send(tok, "POST", "/tokenize", {"prompt": text})
    assert status == 200 and got["count"] == len(tok.encode(text)) > MAX_LEN


def test_a_large_tokenize_is_answered_whole_and_built_off_the_event_loop(tok, monkeypatch):
    """Pieces and JSON in ANSWER_CHUNK slices, on a tokenizer thread: the same body
    json.dumps would write, however many chunks."""
    import pdserve.frontend.tokenization as tokenization

    text = "hello wörld, " * 30_000
    ids = tok.encode(text)
    assert len(ids) > 4 * tokenization.ANSWER_CHUNK
    threads: set[str] = set()

    def spied(items):
        threads.add(threading.current_thread().name)
        return json_list(items)

    json_list = tokenization.json_list
    monkeypatch.setattr(tokenization, "json_list", spied)
    status, got = send(tok, "POST", "/tokenize", {"prompt": text, "return_token_strs": True})
    assert status == 200 and got["count"] == len(ids) and got["tokens"] == ids
    assert got["token_strs"] == [tok.token_piece(t) for t in ids]
    assert threads and all(name.startswith("tokenize-") for name in threads), threads
    for n in (0, 1, tokenization.ANSWER_CHUNK, tokenization.ANSWER_CHUNK + 1):
        assert json_list(ids[:n]) == json.dumps(ids[:n])


def test_tokenize_messages_as_chat_renders_them(tok):
    status, got = send(tok, "POST", "/tokenize", {"messages": MESSAGES})
    assert status == 200
    assert got["tokens"] == tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)
    turns = [*MESSAGES, {"role": "assistant", "content": "Blue"}]
    body = {"messages": turns, "continue_final_message": True}
    status, got = send(tok, "POST", "/tokenize", body)
    text = tok.apply_chat_template(turns, add_generation_prompt=False, continue_final_message=True)
    assert status == 200 and tok.decode(got["tokens"], skip_special_tokens=False) == text
    assert text.endswith("Blue")


def test_detokenize(tok):
    ids = tok.encode("<|im_start|>héllo 界", add_special_tokens=False)
    status, got = send(tok, "POST", "/detokenize", {"model": "tiny", "tokens": ids})
    assert status == 200 and got == {"prompt": "<|im_start|>héllo 界"}  # specials kept
    assert send(tok, "POST", "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


def test_version():
    api = OpenAIApi(Scripted(10, 10), None, "m", 10, 5.0)
    try:
        status, got = call(api, "GET", "/version")
    finally:
        api.close()
    assert status == 200 and got == {"version": VERSION} and VERSION != "unknown"


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": ["x"]}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/tokenize", {"prompt": "x", "model": 5}, "model"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "return_token_strs": 1}, "return_token_strs"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"messages": 1}},
         "chat_template_kwargs"),
        ("/tokenize", {"messages": MESSAGES, "tools": "f"}, "tools"),
        ("/tokenize", {"messages": MESSAGES, "chat_template": 5}, "chat_template"),
        ("/tokenize", {"prompt": "a\ud800"}, "prompt"),
        ("/tokenize", [1], None),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [2**40]}, "tokens"),
        ("/detokenize", {"tokens": [1.0]}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(tok, path, body, param):
    status, got = send(tok, "POST", path, body)
    assert status == (404 if param == "model" and body.get("model") == "other" else 400), got
    assert got["error"]["param"] == param, got
