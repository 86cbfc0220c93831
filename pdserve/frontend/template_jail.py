"""A chat template a client sent (the request's `chat_template`), rendered in helper processes.

The sandbox (model/chat_template.py) keeps a template from reaching Python, not from costing:
nested loops over `range(100000)`, or a string doubled in a loop, take what CPU and memory they
like, and a thread cannot be interrupted. So a client's template renders in a helper process
(`python -m pdserve.frontend.template_jail`), in the same environment as the model's own
template, under limits a process can be held to:

* memory: the helper's address space is capped at what it started with plus MEMORY_BYTES; a
  template that needs more fails with MemoryError (the request's 400), and the helper exits;
* time: a render gets RENDER_TIMEOUT_S, the template's writing into the helper included (a
  helper's start, which says "ready" once its imports are done, has START_TIMEOUT_S of its
  own), then the helper is killed, by pid, and the next render starts a fresh one; a helper
  that does not take the template at all (stopped, wedged) is the server's trouble (JailDown);
* output: a text longer than the caller's bound is refused before it is sent back;
* what it can reach: it starts with a scrubbed environment (PASSED_ENV: what Python needs to
  start, nothing of pdserve's, so neither the API key nor the cluster key file's name), and
  once ready it can open no file or socket (RLIMIT_NOFILE 0, the hard limit too, so it cannot
  be raised again; its open pipes still work, and closing one frees no number to open). That
  holds a sandbox escape back from reading the cluster key or another process's environment
  through /proc; the helper still runs as the server's user, so what is in its memory and the
  pipes is all it has.

A helper is a line child (runtime/line_child.py, which starts, asks and kills it): it reads
one JSON request a line on stdin and answers one JSON line on stdout; it exits at EOF and dies
with the thread that started it (PR_SET_PDEATHSIG, runtime/child.py's `die_with_parent`).
`TemplateJail` keeps HELPERS helpers, started at first use, each rendering one template at a
time; frontend/api.py calls it from a pool of as many threads of its own, so a client's
template never holds a tokenizer thread. The template is the request's text: nothing is
loaded from a path.
"""

from __future__ import annotations

import importlib
import json
import queue
import resource
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.model.chat_template import render_chat
from pdserve.runtime.line_child import (
    ChildDied,
    ChildNotStarted,
    LineChild,
    NotTaken,
    Unanswered,
    cap_memory,
    child_begins,
    say_ready,
)

HELPERS = 2  # templates rendered at once, per front end
RENDER_TIMEOUT_S = 3.0  # one render
START_TIMEOUT_S = 20.0  # a helper's start, until it says it is ready (an interpreter, jinja2)
MEMORY_BYTES = 256 * 2**20  # a helper's address space beyond what it starts with
STOP_WAIT_S = 2.0  # for a helper to exit at EOF before it is killed
OPEN_FILES = 0  # a ready helper may open no descriptor (it keeps stdin, stdout and stderr)
# The environment a helper gets from the server's: what Python needs to start and find its
# packages, the locale and the time zone (strftime_now). Nothing else: no PDSERVE_* variable
# (the API key, the cluster key file's path), no credentials of any other program.
PASSED_ENV = frozenset(
    {"PATH", "HOME", "PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "LD_LIBRARY_PATH"}
    | {"LANG", "LANGUAGE", "TZ"}
)
PASSED_ENV_PREFIXES = ("LC_",)
# Imported inside functions by jinja2 (an error's traceback, wordwrap, pprint, lipsum), its
# lexer (a string literal's escapes) and markupsafe (striptags): a ready helper could not.
LAZY_MODULES = (
    "jinja2.debug",
    "jinja2.constants",
    "textwrap",
    "pprint",
    "html",
    "encodings.unicode_escape",
)
WARM_UP = (  # rendered once before the limit: a literal, filters, a call, then an error
    "{{ 'a\\n' ~ messages[0].content | trim | tojson }}{{ strftime_now('%Y') }}",
    "{{ raise_exception('warm-up') }}",
)


class TemplateRefused(ValueError):
    """The client's template did not render: its error, or the limit it ran into."""


class JailDown(RuntimeError):
    """A helper could not be started: the server's trouble, not the template's."""


class _Helper:
    """One helper process (a line child: runtime/line_child.py), restarted after it is killed
    or dies."""

    def __init__(self, timeout_s: float, memory_bytes: int) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.child = LineChild(
            __name__,
            "a template renderer",
            memory_bytes=memory_bytes,
            passed_env=PASSED_ENV,
            passed_prefixes=PASSED_ENV_PREFIXES,
        )

    def render(self, request: dict[str, Any]) -> str:
        if not self.child.running():
            try:
                self.child.start(time.monotonic() + START_TIMEOUT_S)
            except ChildNotStarted as e:
                raise JailDown(str(e)) from e
        deadline = time.monotonic() + self.timeout_s
        line = json.dumps(request, ensure_ascii=False).encode() + b"\n"
        try:
            answer = self.child.ask(line, deadline)
        except NotTaken as e:  # it reads no input (stopped, wedged): not the template's doing
            self.child.kill()
            raise JailDown(
                f"a template renderer did not take the template within {self.timeout_s:g}s"
            ) from e
        except Unanswered:
            self.child.kill()
            raise TemplateRefused(
                f"the chat_template did not render within {self.timeout_s:g}s"
            ) from None
        except ChildDied as e:  # its memory limit, most likely
            self.child.kill()
            raise TemplateRefused(
                f"the chat_template's renderer died (it may need more memory than "
                f"{self.memory_bytes // 2**20} MiB)"
            ) from e
        reply = json.loads(answer)
        if "error" in reply:
            if reply.get("exited"):
                self.child.stop(STOP_WAIT_S)
            raise TemplateRefused(reply["error"])
        text: str = reply["text"]
        return text


class TemplateJail:
    """Renders clients' chat templates in HELPERS helper processes."""

    def __init__(
        self, timeout_s: float = RENDER_TIMEOUT_S, memory_bytes: int = MEMORY_BYTES
    ) -> None:
        self._idle: queue.SimpleQueue[_Helper] = queue.SimpleQueue()
        self._helpers = [_Helper(timeout_s, memory_bytes) for _ in range(HELPERS)]
        for h in self._helpers:
            self._idle.put(h)

    def render(
        self,
        template: str,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        variables: Mapping[str, Any],
        max_chars: int | None,
    ) -> str:
        """`template` rendered as model/chat_template.render_chat renders it; TemplateRefused
        for its error, a limit, or a text longer than `max_chars`; JailDown if no helper can
        be started. Blocks: call it from a thread, at most HELPERS at once."""
        request = {
            "template": template,
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
            "variables": dict(variables),
            "max_chars": max_chars,
        }
        helper = self._idle.get()
        try:
            return helper.render(request)
        finally:
            self._idle.put(helper)

    def pids(self) -> list[int]:
        """The running helpers' pids."""
        return [pid for h in self._helpers if (pid := h.child.pid()) is not None]

    def close(self) -> None:
        """Kill every helper, by pid (a render in flight fails)."""
        for h in self._helpers:
            h.child.kill()


# -- the helper process -------------------------------------------------------------------
def _close_the_filesystem() -> None:
    """No descriptor can be opened from here on: no file, socket or pipe (soft and hard
    limit, so no escape raises it). What a render would otherwise read on first use is read
    first: the modules jinja2 and its lexer import lazily, and the time zone (strftime_now)."""
    for module in LAZY_MODULES:
        importlib.import_module(module)
    for template in WARM_UP:
        try:
            render_chat(template, [{"role": "user", "content": "hi"}], True, {})
        except ValueError:
            pass  # the error path is part of the warm-up
    time.localtime()
    # 0, not 3: the limit is on descriptor numbers, so at 3 a helper that closed fd 2 could
    # open a file there; at 0 no new descriptor can be had, and the open ones still work.
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


def _answer(request: dict[str, Any]) -> dict[str, Any]:
    try:
        text = render_chat(
            request["template"],
            request["messages"],
            request["add_generation_prompt"],
            request["variables"],
        )
    except ValueError as e:
        if isinstance(e.__cause__, MemoryError):
            return {"error": "the chat_template needs too much memory to render", "exited": True}
        return {"error": str(e)}
    limit = request["max_chars"]
    if limit is not None and len(text) > limit:
        return {"error": f"the chat_template renders {len(text)} characters; at most {limit}"}
    return {"text": text}


def main(argv: list[str]) -> int:
    extra = child_begins(argv)
    cap_memory(extra)  # after the imports: jinja2's own memory is not the template's
    _close_the_filesystem()
    say_ready()
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        try:
            reply = _answer(json.loads(line))
        except MemoryError:
            reply = {"error": "the chat_template needs too much memory to render", "exited": True}
        out.write(json.dumps(reply, ensure_ascii=False).encode() + b"\n")
        out.flush()
        if reply.get("exited"):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
