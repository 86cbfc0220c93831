"""What a template jail helper (frontend/template_jail.py) can reach: an environment scrubbed
of the server's secrets (no PDSERVE_* variable, nothing outside what Python needs) and, once
ready, no descriptor it could open; it still renders, with the time zone it was started in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.frontend.template_jail import (
    OPEN_FILES,
    PASSED_ENV,
    PASSED_ENV_PREFIXES,
    TemplateJail,
    TemplateRefused,
)
from pdserve.model.chat_template import render_chat
from pdserve.runtime.cluster_key import KEY_FILE_ENV
from pdserve.runtime.line_child import scrubbed_env

pytestmark = pytest.mark.process  # the jail starts helper processes

SECRETS = {
    "PDSERVE_API_KEY": "sk-the-api-key",
    KEY_FILE_ENV: "/somewhere/cluster.key",
    "AWS_SECRET_ACCESS_KEY": "another-programs-secret",
}


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def open_files_limit(pid: int) -> tuple[str, str]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return soft, hard
    raise AssertionError("no open-files limit listed")


def test_helper_env_keeps_only_what_python_needs():
    parent = {**SECRETS, "PATH": "/bin", "LC_ALL": "C.UTF-8", "PYTHONPATH": "/x", "TZ": "UTC"}
    env = scrubbed_env(parent, PASSED_ENV, PASSED_ENV_PREFIXES)
    assert not set(SECRETS) & set(env)
    assert env["PATH"] == "/bin" and env["LC_ALL"] == "C.UTF-8" and env["TZ"] == "UTC"
    root = str(Path(__file__).resolve().parents[2])  # this pdserve, first
    assert env["PYTHONPATH"] == f"{root}{os.pathsep}/x"
    assert set(env) <= PASSED_ENV | {"LC_ALL"}


def test_a_running_helper_has_no_secret_and_can_open_nothing(monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    jail = TemplateJail()
    try:
        text = jail.render(
            "{{ strftime_now('%Y') }}:{{ messages[0].content }}",
            [{"role": "user", "content": "hi"}],
            False,
            {},
            None,
        )
        assert text.endswith(":hi") and text.split(":")[0].isdigit()
        (pid,) = jail.pids()  # the one helper that rendered
        env = environ_of(pid)
        assert not set(SECRETS) & set(env), env
        assert not any(k.startswith("PDSERVE_") for k in env), env
        assert "PATH" in env
        assert open_files_limit(pid) == (str(OPEN_FILES), str(OPEN_FILES))
    finally:
        jail.close()


# Most of jinja2's filters and tests, literals with escapes, namespaces, macros and loops: what
# a ready helper renders without opening a file, exactly as the server's own process renders.
EVERYTHING = """{%- set ns = namespace(n=0) -%}
{%- macro show(m) -%}[{{ m.role | upper }}|{{ m.content | e }}]{%- endmacro -%}
{%- for m in messages -%}{{ show(m) }}{% set ns.n = ns.n + 1 %}{%- endfor -%}
{{ ns.n }} {{ 'tab\\t"q"\\u00e9' | tojson }} {{ "x" | center(5) }} {{ 3.14159 | round(2) }}
{{ messages | map(attribute='content') | join(',') }} {{ messages | selectattr('role', 'eq',
'user') | list | length }} {{ [3, 1, 2] | sort | reverse | list }} {{ [1, 1, 2] | unique |
list }} {{ {'b': 1, 'a': 2} | dictsort }} {{ 'a b c' | wordcount }} {{ 'hello world' |
title }} {{ 'long words here' | wordwrap(5) }} {{ {'a': 1} | pprint }} {{ 'x&y' | urlencode
}} {{ 1234567 | filesizeformat }} {{ '<b>t</b>' | striptags }} {{ '%s-%d' | format('a', 2)
}} {{ [1, 2, 3, 4] | batch(2) | list }} {{ [1, 2, 3] | slice(2) | list }} {{ [1, 2] | sum
}} {{ messages | groupby('role') | list | length }} {{ 'abcdef' | truncate(4, True, '') }}
{{ 'x' is string }} {{ 2 is divisibleby 2 }} {{ none is none }} {{ 'a' in 'abc' }} {{ '7' |
int + '1.5' | float }} {{ [2, 5] | max }} {{ [2, 5] | min }} {{ 'ab' | first }}{{ 'ab' |
last }} {{ 'a\\nb' | indent(2) }} {{ 'aXb' | replace('X', '-') | capitalize }}
{{ {'k': 'v'} | items | list }} {{ 'x' | default('y') }} {{ undefined_thing | default('d') }}
{%- if add_generation_prompt %}<gen>{% endif -%}"""


def test_a_ready_helper_renders_what_the_server_renders():
    messages = [{"role": "user", "content": "a<b"}, {"role": "assistant", "content": "c"}]
    jail = TemplateJail()
    try:
        got = jail.render(EVERYTHING, messages, True, {}, None)
        assert got == render_chat(EVERYTHING, messages, True, {})
        with pytest.raises(TemplateRefused, match="no such"):  # the error path, after a render
            jail.render("{{ raise_exception('no such') }}", messages, False, {}, None)
        assert jail.render(EVERYTHING, messages, False, {}, None) == render_chat(
            EVERYTHING, messages, False, {}
        )
    finally:
        jail.close()
