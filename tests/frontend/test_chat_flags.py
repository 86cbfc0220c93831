"""The front end's chat flags (config.FrontendConfig) on `serve`, `router` and `launch`:
`--tool-call-parser NAME|auto` and `--trust-request-chat-template`, off by default (vLLM's
since GHSA-6fvq-23cw-5628 and GHSA-4hw3-g54f-xfrj): a request's own chat_template is then a
400 naming the field and the flag, on /v1/chat/completions as on /tokenize, and no helper
process renders it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve import cli
from pdserve.config import FrontendConfig
from pdserve.frontend.api import OpenAIApi
from pdserve.runtime.launcher import router_argv
from tests.frontend.fakes import Scripted, call
from tests.frontend.tool_models import tokenizer
from tests.router.test_launch import config

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
ASK = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": ASK, "chat_template": TEMPLATE, "max_tokens": 1}),
        ("/tokenize", {"messages": ASK, "chat_template": TEMPLATE}),
    ],
)
def test_a_requests_own_template_is_refused_unless_trusted(path: str, body: dict[str, Any]):
    api = OpenAIApi(Scripted(4200, 512), tokenizer(), "m", 512, 5.0)
    try:
        status, answer = call(api, "POST", path, body)
        assert status == 400, answer
        assert answer["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in answer["error"]["message"]
        assert api.prompts.jail.pids() == []  # nothing was started to render it
        plain = {k: v for k, v in body.items() if k != "chat_template"}
        status, answer = call(api, "POST", path, plain)
        assert status == 200, answer
    finally:
        api.close()


def test_an_unknown_parser_is_refused_at_start():
    with pytest.raises(ValueError, match="unknown tool call parser 'qwen'"):
        OpenAIApi(Scripted(4200, 512), tokenizer(), "m", 512, 5.0, None, FrontendConfig("qwen"))
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--model", "m", "--tool-call-parser", "qwen"])


@pytest.mark.parametrize("command", ["serve", "router"])
def test_serve_and_router_pass_the_flags_to_their_front_end(
    command: str, monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    seen: list[FrontendConfig] = []
    if command == "serve":
        from pdserve.worker import server as process

        monkeypatch.setattr(process, "run_server", lambda cfg: seen.append(cfg.frontend))
        argv = ["serve", "--model", str(tiny_dir)]
    else:
        from pdserve.router import app

        monkeypatch.setattr(app, "run_router", lambda cfg: seen.append(cfg.frontend))
        argv = ["router", "--model", "/nonexistent", "--decode", "http://127.0.0.1:1"]
    parser = cli.build_parser()
    for flags, want in (
        ([], FrontendConfig()),
        (
            ["--tool-call-parser", "hermes", "--trust-request-chat-template"],
            FrontendConfig("hermes", True),
        ),
    ):
        args = parser.parse_args([*argv, *flags])
        args.func(args)
        assert seen[-1] == want


def test_launch_gives_the_flags_to_its_router():
    args = cli.build_parser().parse_args(
        ["launch", "--model", "m", "--tool-call-parser", "mistral", "--trust-request-chat-template"]
    )
    assert (args.tool_call_parser, args.trust_request_chat_template) == ("mistral", True)
    argv = router_argv(
        config(tool_call_parser="mistral", trust_request_chat_template=True), [], ["http://d0"]
    )
    assert argv[argv.index("--tool-call-parser") + 1] == "mistral"
    assert "--trust-request-chat-template" in argv
    plain = router_argv(config(), [], ["http://d0"])
    assert plain[plain.index("--tool-call-parser") + 1] == "auto"
    assert "--trust-request-chat-template" not in plain
