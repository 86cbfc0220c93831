"""A chat template a client sent (the request's `chat_template`), rendered in helper processes.

The sandbox (model/chat_template.py) keeps a template from reaching Python, not from costing:
nested loops over `range(100000)`, or a string doubled in a loop, take what CPU and memory they
like, and a thread cannot be interrupted. So a client's template renders in a helper process
(`python -m pdserve.frontend.template_jail`), in the same environment as the model's own
template, under limits a process can be held to:

* memory: the helper's address space is capped at what it started with plus MEMORY_BYTES; a
  template that needs more fails with MemoryError (the request's 400), and the helper exits;
* time: a render gets RENDER_TIMEOUT_S (a helper's start, which says "ready" once its imports
  are done, has START_TIMEOUT_S of its own), then the helper is killed, by pid, and the next
  render starts a fresh one;
* output: a text longer than the caller's bound is refused before it is sent back;
* what it can reach: it starts with a scrubbed environment (`helper_env`: what Python needs to
  start, nothing of pdserve's, so neither the API key nor the cluster key file's name), and
  once ready it can open no file or socket (RLIMIT_NOFILE 0, the hard limit too, so it cannot
  be raised again; its open pipes still work, and closing one frees no number to open). That
  holds a sandbox escape back from reading the cluster key or another process's environment
  through /proc; the helper still runs as the server's user, so what is in its memory and the
  pipes is all it has.

A helper reads one JSON request a line on stdin and answers one JSON line on stdout; it exits
at EOF and dies with the thread that started it (PR_SET_PDEATHSIG). `TemplateJail` keeps
HELPERS helpers, started at first use, each rendering one template at a time; frontend/api.py
calls it from a pool of as many threads of its own, so a client's template never holds a
tokenizer thread. The template is the request's text: nothing is loaded from a path.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import queue
import resource
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.model.chat_template import render_chat

HELPERS = 2  # templates rendered at once, per front end
RENDER_TIMEOUT_S = 3.0  # one render
START_TIMEOUT_S = 20.0  # a helper's start, until it says it is ready (an interpreter, jinja2)
MEMORY_BYTES = 256 * 2**20  # a helper's address space beyond what it starts with
STOP_WAIT_S = 2.0  # for a helper to exit at EOF before it is killed
PR_SET_PDEATHSIG = 1
READY = b"ready\n"  # a helper's first line
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
    """One helper process, restarted after it is killed or dies."""

    def __init__(self, timeout_s: float, memory_bytes: int) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.proc: subprocess.Popen[bytes] | None = None

    def render(self, request: dict[str, Any]) -> str:
        proc = self._running()
        assert proc.stdin is not None and proc.stdout is not None
        deadline = time.monotonic() + self.timeout_s
        try:
            _write_all(
                proc.stdin.fileno(), json.dumps(request, ensure_ascii=False).encode() + b"\n"
            )
            line = _read_line(proc.stdout.fileno(), deadline)
        except OSError as e:  # it died (a broken pipe): its memory limit, most likely
            self.stop(force=True)
            raise TemplateRefused(f"the chat_template's renderer failed ({e})") from e
        if line is None:
            self.stop(force=True)
            raise TemplateRefused(f"the chat_template did not render within {self.timeout_s:g}s")
        if not line:
            self.stop(force=True)
            raise TemplateRefused(
                f"the chat_template's renderer died (it may need more than "
                f"{self.memory_bytes // 2**20} MiB)"
            )
        reply = json.loads(line)
        if "error" in reply:
            if reply.get("exited"):
                self.stop()
            raise TemplateRefused(reply["error"])
        text: str = reply["text"]
        return text

    def _running(self) -> subprocess.Popen[bytes]:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        self.stop()
        argv = [sys.executable, "-m", __name__, str(os.getpid()), str(self.memory_bytes)]
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,
                env=helper_env(os.environ),
            )
        except OSError as e:  # out of processes or descriptors
            raise JailDown(f"a template renderer could not be started: {e}") from e
        self.proc = proc
        assert proc.stdout is not None
        if _read_line(proc.stdout.fileno(), time.monotonic() + START_TIMEOUT_S) != READY:
            self.stop(force=True)
            raise JailDown(f"a template renderer did not start within {START_TIMEOUT_S:g}s")
        return proc

    def stop(self, force: bool = False) -> None:
        """End the helper: EOF and a bounded wait, then SIGKILL (by pid); `force`: SIGKILL
        at once (it is stuck in a render)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if force and proc.poll() is None:
            proc.kill()
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass  # it is gone already
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_WAIT_S)
        if proc.stdout is not None:
            proc.stdout.close()


def helper_env(parent: Mapping[str, str]) -> dict[str, str]:
    """A helper's environment: PASSED_ENV and the locale's LC_* from `parent`, with this
    pdserve's directory first on PYTHONPATH (the helper imports the same code however the
    server found it)."""
    env = {k: v for k, v in parent.items() if k in PASSED_ENV or k.startswith(PASSED_ENV_PREFIXES)}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_line(fd: int, deadline: float) -> bytes | None:
    """One line from `fd`; b"" at EOF; None past `deadline`."""
    buf = bytearray()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            return None
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b""
        buf += chunk
        if buf.endswith(b"\n"):
            return bytes(buf)


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
        return [h.proc.pid for h in self._helpers if h.proc is not None]

    def close(self) -> None:
        """Kill every helper, by pid (a render in flight fails)."""
        for h in self._helpers:
            h.stop(force=True)


# -- the helper process -------------------------------------------------------------------
def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl
        os._exit(1)


def _cap_memory(extra: int) -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * page
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, hard))


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
    parent, extra = int(argv[0]), int(argv[1])
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's ^C is the parent's to handle
    _cap_memory(extra)  # after the imports: jinja2's own memory is not the template's
    _close_the_filesystem()
    out = sys.stdout.buffer
    out.write(READY)
    out.flush()
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
