"""The worker-facing API (/generate NDJSON, /abort, /info, /debug/invariants)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.procs import auth_headers, http

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


def ndjson(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), auth_headers())
    with urllib.request.urlopen(req, timeout=60) as r:
        return [json.loads(line) for line in r if line.strip()]


def test_generate_stream_ends_with_finish_reason(tiny_server):
    lines = ndjson(
        tiny_server.url + "/generate",
        {
            "request_id": "w1",
            "prompt_ids": [5, 6, 7],
            "params": {"max_tokens": 4, "temperature": 0, "ignore_eos": True},
        },
    )
    assert [ln["finish_reason"] for ln in lines][-1] == "length"
    assert sum(len(ln["token_ids"]) for ln in lines) == 4
    assert all(ln["finish_reason"] is None for ln in lines[:-1])


def test_generate_rejects_bad_params_and_info(tiny_server):
    status, body = http(
        "POST",
        tiny_server.url + "/generate",
        {"request_id": "w2", "prompt_ids": [1], "params": {"top_p": 3}},
    )
    assert status == 400 and body["error"]["param"] == "top_p"
    status, body = http(
        "POST", tiny_server.url + "/generate", {"request_id": "w3", "prompt_ids": "x"}
    )
    assert status == 400 and body["error"]["param"] == "prompt_ids"
    status, info = http("GET", tiny_server.url + "/info")
    assert status == 200 and info["role"] == "colocated" and info["max_model_len"] == 1024
    assert info["layout"]["page_size"] == 16


def test_abort_unknown_is_harmless_and_invariants_hold(tiny_server):
    assert http("POST", tiny_server.url + "/abort", {"request_id": "nope"})[0] == 200
    assert http("POST", tiny_server.url + "/abort", raw=b"[")[0] == 400
    status, inv = http("GET", tiny_server.url + "/debug/invariants")
    assert status == 200 and inv["ok"], inv


def test_a_generate_that_its_abort_overtook_is_refused(tiny_server):
    """The router's /abort came on a warm connection before its /generate on a new one: the
    /generate is refused (409) and never reaches the engine (worker/http/aborted_ids.py)."""
    assert http("POST", tiny_server.url + "/abort", {"request_ids": ["late-1"]})[0] == 200
    body = {"request_id": "late-1", "prompt_ids": [5, 6], "params": {"max_tokens": 400}}
    status, answer = http("POST", tiny_server.url + "/generate", body)
    assert status == 409 and answer["error"]["code"] == "aborted", answer
    status, inv = http("GET", tiny_server.url + "/debug/invariants")
    assert status == 200 and inv["ok"], inv  # nothing runs
    body["request_id"] = "late-2"  # another id is served as ever
    assert ndjson(tiny_server.url + "/generate", {**body, "params": {"max_tokens": 2}})
