"""`--reject-unknown-fields` of `serve` and `router`: the process's choice for request fields
pdserve does not know (frontend/fields.py), lenient by default as in vLLM."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pdserve import cli
from pdserve.frontend import fields
from pdserve.frontend.api import OpenAIApi
from pdserve.frontend.protocol import ApiError, parse_chat, parse_completion
from tests.frontend.fakes import Tokenizer, app_with
from tests.frontend.test_chat_tools import PromptKeeper

ODD = {"prompt": "ab", "max_tokens": 1, "service_tier": "auto"}


@pytest.fixture
def restore() -> Iterator[None]:
    before = fields._reject_unknown
    yield
    fields.reject_unknown_fields(before)


def test_the_process_choice_applies_unless_a_parse_says_strict(restore: None) -> None:
    assert parse_completion(ODD).n == 1  # the default: lenient
    fields.reject_unknown_fields(True)
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{"role": "user", "content": "x"}], "service_tier": "auto"})
    assert e.value.status == 400 and e.value.param == "service_tier"
    assert parse_completion(ODD, strict=False).n == 1


def test_a_rejecting_server_answers_400_naming_the_field(restore: None) -> None:
    fields.reject_unknown_fields(True)
    api = OpenAIApi(PromptKeeper(), Tokenizer(), "m", 64, 5.0)

    async def go() -> tuple[int, Any]:
        async with TestClient(TestServer(app_with(api))) as client:
            r = await client.post("/v1/completions", json=ODD)
            return r.status, await r.json()

    status, body = asyncio.run(go())
    assert status == 400 and body["error"]["param"] == "service_tier"
    assert "unknown field 'service_tier'" in body["error"]["message"]


@pytest.mark.parametrize("command", ["serve", "router"])
def test_serve_and_router_set_the_choice_before_serving(
    command: str, restore: None, monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    seen: list[bool] = []
    if command == "serve":
        from pdserve.worker import server as process

        monkeypatch.setattr(process, "run_server", lambda cfg: seen.append(fields._reject_unknown))
        argv = ["serve", "--model", str(tiny_dir)]  # serve reads the model's config
    else:
        from pdserve.router import app

        monkeypatch.setattr(app, "run_router", lambda cfg: seen.append(fields._reject_unknown))
        argv = ["router", "--model", "/nonexistent", "--decode", "http://127.0.0.1:1"]
    parser = cli.build_parser()
    for flag, want in (([], False), (["--reject-unknown-fields"], True)):
        args = parser.parse_args([*argv, *flag])
        args.func(args)
        assert seen[-1] is want
