"""A client's own chat_template (frontend/template_jail.py): rendered as the model's template
renders, in helper processes whose time and memory are bounded, so a hostile template costs
its own request a 400 naming `chat_template`, and nothing else: other requests are served
meanwhile, and the next template renders in a fresh helper.

Real aiohttp apps in this process, the tiny model's real tokenizer, a fake engine; the helper
processes are stopped (by pid) when each test closes its API, whatever the test's outcome."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pdserve.config import FrontendConfig
from pdserve.frontend.api import OpenAIApi
from pdserve.frontend.chat import MAX_TEMPLATE_CHARS
from pdserve.frontend.template_jail import HELPERS, JailDown, TemplateJail, TemplateRefused
from pdserve.model.builtin import CHATML_TEMPLATE
from pdserve.model.tokenizer import Tokenizer
from pdserve.runtime.pids import wait_gone
from tests.frontend.fakes import Scripted, app_with, call

pytestmark = pytest.mark.process  # the jail starts helper processes

MAX_LEN = 256
TIMEOUT_S = 1.5
TURNS = [{"role": "user", "content": "Name a colour."}]
SIMPLE = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
SIMPLE += "{% if add_generation_prompt %}[assistant] {% endif %}"


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


class Served:
    """An API whose jail renders within TIMEOUT_S; closed (helpers stopped by pid) on exit."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.engine = Scripted(4096, MAX_LEN)
        trusted = FrontendConfig(trust_request_chat_template=True)
        self.api = OpenAIApi(self.engine, tok, "m", MAX_LEN, 5.0, 4000, trusted)
        self.api.prompts.jail = TemplateJail(timeout_s=TIMEOUT_S)
        self.pids: set[int] = set()

    def chat(self, **body: Any) -> tuple[int, Any, str | None]:
        n = len(self.engine.prompts)
        status, answer = call(self.api, "POST", "/v1/chat/completions", {"max_tokens": 1, **body})
        self.pids |= set(self.api.prompts.jail.pids())
        sent = self.engine.prompts[n:]
        prompt = self.tok.decode(sent[0], skip_special_tokens=False) if sent else None
        return status, answer, prompt

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.api.close()
        assert wait_gone(sorted(self.pids), 10.0) == [], "a helper outlived close()"


def test_a_clients_template_renders_as_the_models_would(tok):
    with Served(tok) as s:
        status, answer, prompt = s.chat(messages=TURNS, chat_template=SIMPLE)
        assert status == 200, answer
        assert prompt == "<|endoftext|>[user] Name a colour.\n[assistant] "
        # the model's own template, sent as the client's: the same prompt as without it
        status, _, mine = s.chat(messages=TURNS, chat_template=CHATML_TEMPLATE)
        assert status == 200 and mine == s.chat(messages=TURNS)[2]
        turns = [*TURNS, {"role": "assistant", "content": "Blue"}]
        _, _, cont = s.chat(messages=turns, chat_template=SIMPLE, continue_final_message=True)
        assert cont == "<|endoftext|>[user] Name a colour.\n[assistant] Blue"
        kw = {"chat_template": "{{ greeting }}", "chat_template_kwargs": {"greeting": "hey"}}
        assert s.chat(messages=TURNS, **kw)[2] == "hey"


HOSTILE = [
    # nested loops: 10^10 iterations
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "within"),
    # a string doubled 60 times: exabytes
    (
        "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s | length }}",
        "memory",
    ),
    ("{{ 'a' * 10**10 }}", "memory"),
    ("{% include '/etc/passwd' %}", "no loader"),
    ("{% import 'os' as os %}", "no loader"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ("{{ messages.__class__ }}x", "x"),  # the sandbox: nothing private is reached
    ("{{ cycler.__init__.__globals__ }}", "unsafe"),
    ("{% for i in range(10**7) %}{% endfor %}", "Range too big"),
    ("{{ 'x' * 5000 }}", "at most 4000"),  # renders past the prompt's character bound
    ("{% for %}", "does not parse"),
    ("{{ raise_exception('no thanks') }}", "no thanks"),
]


@pytest.mark.parametrize("template,words", HOSTILE)
def test_a_hostile_template_is_its_own_requests_400(tok, template, words):
    with Served(tok) as s:
        t0 = time.monotonic()
        status, answer, prompt = s.chat(messages=TURNS, chat_template=template)
        took = time.monotonic() - t0
        if words == "x":  # renders, harmlessly
            assert status == 200 and prompt == "x", answer
            return
        assert status == 400 and prompt is None, answer
        err = answer["error"]
        assert err["param"] == "chat_template" and words in err["message"], err
        assert took < TIMEOUT_S + 3.0
        # the next request renders in a working helper
        assert s.chat(messages=TURNS, chat_template=SIMPLE)[0] == 200


def test_a_template_that_never_ends_holds_up_nobody_else(tok):
    spin = HOSTILE[0][0]
    with Served(tok) as s:

        async def go() -> tuple[list[int], float]:
            async with TestClient(TestServer(app_with(s.api))) as client:

                async def post(body: dict[str, Any]) -> int:
                    r = await client.post("/v1/chat/completions", json={"max_tokens": 1, **body})
                    return r.status

                hostile = [
                    asyncio.ensure_future(post({"messages": TURNS, "chat_template": spin}))
                    for _ in range(4)  # more than the helpers: every one of them is spinning
                ]
                await asyncio.sleep(0.3)
                t0 = time.monotonic()
                assert await post({"messages": TURNS}) == 200  # the model's own template
                plain = time.monotonic() - t0
                statuses = await asyncio.gather(*hostile)
                return list(statuses), plain

        statuses, plain = asyncio.run(go())
        assert statuses == [400] * 4
        assert plain < 1.0  # not queued behind the templates: they have threads of their own


def test_a_template_longer_than_the_bound_is_refused_unrendered(tok):
    with Served(tok) as s:
        status, answer, _ = s.chat(messages=TURNS, chat_template="x" * (MAX_TEMPLATE_CHARS + 1))
        assert status == 400 and answer["error"]["param"] == "chat_template"
        assert s.api.prompts.jail.pids() == []  # no helper was started for it


def test_a_helper_past_its_time_is_killed_and_replaced():
    jail = TemplateJail(timeout_s=TIMEOUT_S)
    try:
        for _ in range(2):  # one render each: both helpers started
            assert jail.render(SIMPLE, TURNS, True, {"bos_token": ""}, None).startswith("[user]")
        started = jail.pids()
        assert len(started) == 2
        with pytest.raises(TemplateRefused, match="within"):
            jail.render(HOSTILE[0][0], TURNS, True, {}, None)
        killed = sorted(set(started) - set(jail.pids()))
        assert len(killed) == 1 and wait_gone(killed, 5.0) == []  # by pid, at once
        for _ in range(2):  # the survivor, then a fresh helper
            assert jail.render("{{ 1 + 1 }}", TURNS, True, {}, None) == "2"
        assert len(jail.pids()) == 2 and killed[0] not in jail.pids()
    finally:
        pids = jail.pids()
        jail.close()
        assert wait_gone(pids, 10.0) == []


def test_a_helper_that_takes_no_template_holds_no_render_past_its_time():
    """A helper that reads nothing (stopped, its pipe full) fails the render within the
    render's time, as the server's trouble; it is killed, and the next render has a fresh one."""
    jail = TemplateJail(timeout_s=TIMEOUT_S)
    pids: list[int] = []
    try:
        for _ in range(HELPERS):  # one render each: every helper started
            jail.render("{{ 1 }}", TURNS, True, {}, None)
        pids = jail.pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        big = [{"role": "user", "content": "x" * 200_000}]  # more than a pipe holds
        for _ in range(HELPERS):
            t0 = time.monotonic()
            with pytest.raises(JailDown, match="did not take the template"):
                jail.render("{{ 1 }}", big, True, {}, None)
            assert time.monotonic() - t0 < TIMEOUT_S + 3.0
        assert wait_gone(pids, 5.0) == [] and jail.pids() == []  # killed, by pid
        assert jail.render("{{ 1 + 1 }}", big, True, {}, None) == "2"
    finally:
        pids += jail.pids()
        jail.close()
        assert wait_gone(pids, 10.0) == []


def test_a_renderer_that_cannot_start_is_the_servers_503(tok, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with Served(tok) as s:
        status, answer, prompt = s.chat(messages=TURNS, chat_template=SIMPLE)
    assert status == 503 and prompt is None and answer["error"]["type"] == "server_error"
