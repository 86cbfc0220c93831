"""A request its own `timeout` ends is a 408 (the client asked for more than it allowed), not a
500: nothing on the server failed. Streams end with an error event that says the same."""

from __future__ import annotations

import json

import pytest

from tests.procs import http

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

LONG = {"prompt": "x", "max_tokens": 900, "ignore_eos": True, "temperature": 0}


def test_a_request_past_its_own_timeout_is_408(tiny_server):
    status, body = http("POST", tiny_server.url + "/v1/completions", {**LONG, "timeout": 0.05})
    assert status == 408, body
    assert body["error"]["type"] == "timeout_error" and body["error"]["code"] == "timeout"
    assert "exceeded its deadline" in body["error"]["message"]


def test_a_stream_past_its_own_timeout_ends_with_a_timeout_event(tiny_server):
    status, text = http(
        "POST", tiny_server.url + "/v1/completions", {**LONG, "timeout": 0.05, "stream": True}
    )
    assert status == 200
    events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert [e["code"] for e in errors] == ["timeout"], events
