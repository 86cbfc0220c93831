"""The GBNF converter (runtime/gbnf_converter.py): a child process converts as llguidance's
converter does in-process; a conversion past its timeout is refused and the next one works on
a fresh child; a child killed or stopped from outside is replaced and never holds a caller past
its timeout, and what it could not convert is the server's trouble, never the grammar's (in the
front end's check and the engine's compile, with the compile's bound at 1 s, nothing
remembers it); a repeated grammar is converted once; the child's memory is capped; it outlives
the thread that started it, dies with the keeper thread that did and with its parent. The
serving sides (the front end's check, the engine) convert GBNF only there.

Each test's converter is closed, and every child it started checked gone by pid, whatever the
test's outcome."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from llguidance.gbnf_to_lark import gbnf_to_lark

import pdserve.protocol.constraint as constraint_module
from pdserve.engine.sampling.grammars import Grammars
from pdserve.frontend.structured import AskedConstraint, build_constraint, check_constraint
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.constraint import Constraint, ConstraintKind, compile_error, grammar_source
from pdserve.protocol.grammar_thread import GRAMMAR_THREAD
from pdserve.protocol.invalid_params import InvalidParams
from pdserve.runtime.gbnf_converter import (
    GBNF_CONVERTER,
    ConversionTimeout,
    ConverterDown,
    GbnfConverter,
)
from pdserve.runtime.pids import wait_gone

pytestmark = pytest.mark.process  # every test here starts a converter's child

ROOT = Path(__file__).resolve().parents[2]
T = 30.0  # a bound no conversion here comes near, on a loaded two-core machine
SLACK_S = 1.0  # a caller's time past its timeout: the kill and the reap, on a loaded machine
BUSY_CPU_S = 0.05  # CPU time an idle child has used once it has a grammar: it is converting
GRAMMARS = [
    'root ::= "a" | "b"',
    'root ::= [a-z]+ ("," [a-z]+)*',
    'root ::= "(" sum ")"\nsum ::= num "+" num | num\nnum ::= [0-9]',
    # llama.cpp's arithmetic example, comments and all
    'root  ::= (expr "=" ws term "\\n")+\n# a comment\nexpr  ::= term ([-+*/] term)*\n'
    'term  ::= ident | num | "(" ws expr ")" ws\nident ::= [a-z] [a-z0-9_]* ws\n'
    "num   ::= [0-9]+ ws\nws    ::= [ \\t\\n]*",
    'root ::= "é" "ü"? [^"\\\\]{2,5}',
]


def chain(rules: int, literal: str = "x") -> str:
    """`rules` GBNF rules each calling the next: the converter's time grows with its square."""
    body = "".join(f'r{i} ::= "{literal}" r{i + 1}\n' for i in range(rules))
    return f'root ::= r0\n{body}r{rules} ::= "{literal}"\n'


class Watched(GbnfConverter):
    """A converter that notes every child's pid, so the test can check them all gone."""

    def __init__(self) -> None:
        super().__init__()
        self.pids: set[int] = set()

    def note(self) -> int:
        pid = self.pid()
        assert pid is not None, "no child running"
        self.pids.add(pid)
        return pid


@pytest.fixture
def conv() -> Iterator[Watched]:
    c = Watched()
    try:
        yield c
    finally:
        pid = c.pid()
        c.close()
        c.pids |= {pid} if pid is not None else set()
        assert wait_gone(sorted(c.pids), 10.0) == [], "a converter's child outlived close()"


def test_it_converts_as_the_in_process_converter(conv):
    for g in GRAMMARS + [chain(300)]:
        assert conv.convert(g, T) == gbnf_to_lark(g), g
        conv.note()
        source = grammar_source(ConstraintKind.GRAMMAR, g, conv.convert)
        assert source == grammar_source(ConstraintKind.GRAMMAR, g)  # in-process, as before
    for bad in ("garbage !!! ###", 'root ::= undefined_rule "a"'):
        with pytest.raises(Exception) as here:
            gbnf_to_lark(bad)
        with pytest.raises(ValueError) as there:
            conv.convert(bad, T)
        assert str(there.value) == str(here.value), bad
    deep = "root ::= " + "(" * 3000 + '"a"' + ")" * 3000  # past Python's recursion limit
    with pytest.raises(RecursionError):
        gbnf_to_lark(deep)
    with pytest.raises(ValueError, match="maximum recursion depth exceeded"):
        conv.convert(deep, T)
    assert conv.started == 1  # one child for all of them


def test_a_repeated_grammar_is_converted_once(conv):
    assert conv.convert(GRAMMARS[2], T) == conv.convert(GRAMMARS[2], T)
    for _ in range(2):
        with pytest.raises(ValueError, match="Expected"):
            conv.convert("garbage !!! ###", T)
    assert conv.conversions == 2


def test_a_conversion_past_its_timeout_is_refused_and_the_next_works(conv):
    conv.convert(GRAMMARS[0], T)
    first = conv.note()
    t0 = time.monotonic()
    with pytest.raises(ConversionTimeout, match="did not convert within 0.2s"):
        conv.convert(chain(1990), 0.2)  # a second or more of converting
    assert time.monotonic() - t0 < 0.2 + SLACK_S
    assert wait_gone([first], 10.0) == []  # killed, by pid
    assert conv.pid() is None
    assert conv.convert(GRAMMARS[1], T) == gbnf_to_lark(GRAMMARS[1])
    assert conv.note() != first and conv.started == 2
    assert conv.convert(chain(1990), T).startswith("%llguidance")  # its timeout not cached


def test_a_child_killed_outside_is_replaced(conv):
    conv.convert(GRAMMARS[0], T)
    first = conv.note()
    os.kill(first, signal.SIGKILL)  # not waited for: the next call may still see it running
    assert conv.convert(GRAMMARS[1], T) == gbnf_to_lark(GRAMMARS[1])
    assert conv.note() != first and conv.started == 2


def test_a_child_killed_while_converting_is_replaced_and_the_call_retried(conv):
    conv.convert(GRAMMARS[0], T)
    first = conv.note()
    slow = chain(1990, "y")  # a second or more of converting
    idle = cpu_s(first)
    with ThreadedCall(conv, slow) as call:
        wait_converting(first, idle)
        os.kill(first, signal.SIGKILL)
    assert call.result == gbnf_to_lark(slow)
    assert conv.note() != first and conv.started == 2 and conv.conversions == 2


def test_a_call_whose_child_dies_twice_is_converter_down_and_not_remembered(conv):
    conv.convert(GRAMMARS[0], T)
    first = conv.note()
    slow = chain(1990, "w")
    idle = cpu_s(first)
    with ThreadedCall(conv, slow) as call:
        wait_converting(first, idle)
        os.kill(first, signal.SIGKILL)
        second = wait_for(lambda: conv.pid() if conv.started == 2 else None)
        conv.pids.add(second)
        wait_converting(second, cpu_s(second))  # the retry, on a fresh child
        os.kill(second, signal.SIGKILL)
    assert isinstance(call.error, ConverterDown) and "twice" in str(call.error), call.error
    assert conv.convert(slow, T) == gbnf_to_lark(slow)  # converted: nothing was remembered
    assert conv.started == 3


def test_a_start_whose_keeper_is_gone_is_converter_down(conv):
    """The keeper thread lives as long as the process; should it end (the interpreter exiting),
    the kernel kills the child it started, and no start is attempted without it."""
    conv.convert(GRAMMARS[0], T)
    pid = conv.note()
    conv._child.starter.shutdown(wait=True)  # type: ignore[union-attr]  # its thread ends
    assert wait_gone([pid], 10.0) == []  # PR_SET_PDEATHSIG: it died with that thread
    with pytest.raises(ConverterDown, match="starter thread gbnf-keeper.* is gone"):
        conv.convert(GRAMMARS[1], T)


def test_the_childs_memory_is_capped(conv):
    conv.convert(GRAMMARS[0], T)
    pid = conv.note()
    limit = address_space_limit(pid)
    size = int(Path(f"/proc/{pid}/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    assert size < limit <= size + conv.memory_bytes


def test_a_stopped_child_holds_no_caller_past_its_timeout(conv):
    conv.convert(GRAMMARS[0], T)
    stop(conv.note())
    t0 = time.monotonic()
    with pytest.raises(ConversionTimeout):  # the grammar went into the pipe; no answer came
        conv.convert(GRAMMARS[1], 0.3)
    assert time.monotonic() - t0 < 0.3 + SLACK_S

    conv.convert(GRAMMARS[0] + " ", T)  # a fresh child
    stop(conv.note())
    big = chain(1990, "z") + "# " + "z" * 100_000 + "\n"  # more than the pipe holds
    t0 = time.monotonic()
    with pytest.raises(ConverterDown, match="did not take the grammar"):
        conv.convert(big, 0.3)
    assert time.monotonic() - t0 < 0.3 + SLACK_S

    conv.convert(GRAMMARS[0] + "  ", T)  # a fresh child, stopped with a caller on it
    stop(conv.note())
    with ThreadedCall(conv, GRAMMARS[2], timeout_s=2.0) as call:
        time.sleep(0.2)
        t0 = time.monotonic()
        with pytest.raises(ConverterDown, match="busy"):  # waited its turn, then gave up
            conv.convert(GRAMMARS[3], 0.3)
        assert time.monotonic() - t0 < 0.3 + SLACK_S
    assert isinstance(call.error, ConversionTimeout)
    assert conv.convert(GRAMMARS[3], T) == gbnf_to_lark(GRAMMARS[3])


def test_the_child_outlives_the_thread_that_started_it(conv):
    starter = threading.Thread(target=conv.convert, args=(GRAMMARS[0], T))
    starter.start()
    starter.join(T)
    pid = conv.note()
    time.sleep(0.3)  # had it been tied to that thread, it would be killed by now
    assert wait_gone([pid], 0.0) == [pid]
    conv.convert(GRAMMARS[1], T)
    assert conv.pid() == pid and conv.started == 1


def test_the_child_dies_with_its_parent():
    """A parent that is SIGKILLed (no clean-up of its own) takes its converter's child, even
    one that would never read the end of its input (stopped here, or deep in a conversion)."""
    script = textwrap.dedent(
        """
        import os, signal, time
        from pdserve.runtime.gbnf_converter import GbnfConverter
        c = GbnfConverter()
        c.convert('root ::= "a"', 30.0)
        os.kill(c.pid(), signal.SIGSTOP)
        print(c.pid(), flush=True)
        time.sleep(60)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env
    )
    child: int | None = None
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert wait_gone([child], 0.0) == [child]  # running
        parent.kill()
        parent.wait(10.0)
        assert wait_gone([child], 10.0) == [], "the converter's child outlived its parent"
    finally:
        parent.kill()
        parent.wait(10.0)
        if child is not None and wait_gone([child], 0.0):
            os.kill(child, signal.SIGKILL)


def test_the_serving_sides_convert_gbnf_only_in_the_child(monkeypatch, tiny_dir):
    """The front end's check (D's /generate makes the same one) and the engine's compile:
    with this process's converter broken, a GBNF grammar still compiles, once."""

    def broken(gbnf: str) -> str:
        raise AssertionError("GBNF converted in the serving process")

    monkeypatch.setattr(constraint_module, "gbnf_to_lark", broken)
    gbnf = 'root ::= "(" num ")"\nnum ::= [0-9]+'
    before = GBNF_CONVERTER.conversions
    compile_error.cache_clear()
    try:
        c = build_constraint(AskedConstraint("guided_grammar", ConstraintKind.GRAMMAR, gbnf))
        check_constraint(c)
        with pytest.raises(Exception, match="GBNF grammar does not convert"):
            Constraint(kind=ConstraintKind.GRAMMAR, spec=gbnf).check_compiles()  # in-process
        tok = Tokenizer.from_dir(tiny_dir)
        matcher = Grammars(lambda: tok, tok.vocab_size, frozenset()).compiled(c)
        assert not matcher.is_error()
        assert GBNF_CONVERTER.conversions == before + 1  # once for the front end and engine
    finally:
        compile_error.cache_clear()


def test_a_grammar_the_converter_could_not_run_is_busy_never_remembered(monkeypatch, tiny_dir):
    """With the compile's bound at 1 s, an innocent grammar whose turn did not come (another
    grammar holds the converter) or that a stopped converter did not take is "not compiled"
    (the server's trouble) before the compile's deadline, in the front end's check as in the
    engine, and nothing remembers it: once the converter is free it compiles."""
    tok = Tokenizer.from_dir(tiny_dir)
    grammars = Grammars(lambda: tok, tok.vocab_size, frozenset())
    assert not grammars.compiled(
        Constraint(kind=ConstraintKind.GRAMMAR, spec='start: "x"')
    ).is_error()
    GBNF_CONVERTER.convert(GRAMMARS[0], T)  # the child started, its imports not in the bound
    innocent = Constraint(kind=ConstraintKind.GRAMMAR, spec='root ::= "innocent"')
    # more than a pipe holds, so a child that reads nothing does not take it
    padded = Constraint(kind=ConstraintKind.GRAMMAR, spec=innocent.spec + "\n# " + "z" * 100_000)
    with monkeypatch.context() as m:
        m.setattr(GRAMMAR_THREAD, "timeout_s", 1.0)
        with GBNF_CONVERTER._turn:  # another grammar's conversion holds the converter
            t0 = time.monotonic()
            with pytest.raises(
                InvalidParams, match="grammar was not compiled: .*busy with another"
            ):
                check_constraint(innocent)
            assert time.monotonic() - t0 < 1.0
            with pytest.raises(ValueError, match="was not compiled: .*busy with another"):
                grammars.compiled(innocent)
        stop(GBNF_CONVERTER.pid() or 0)  # a converter that takes no input
        with pytest.raises(InvalidParams, match="was not compiled: .*did not take the grammar"):
            check_constraint(padded)
        GBNF_CONVERTER.convert(GRAMMARS[1], T)  # a fresh child, stopped for the engine's turn
        stop(GBNF_CONVERTER.pid() or 0)
        grammars.sweep()
        with pytest.raises(ValueError, match="was not compiled: .*did not take the grammar"):
            grammars.compiled(padded)
        assert compile_error.cache_info().currsize == 0
    grammars.sweep()  # the engine forgets a busy refusal at its next sweep
    for c in (innocent, padded):
        check_constraint(c)
        assert not grammars.compiled(c).is_error()


class ThreadedCall:
    """`conv.convert(gbnf, timeout_s)` on a thread while the test acts; joined on exit."""

    def __init__(self, conv: GbnfConverter, gbnf: str, timeout_s: float = T) -> None:
        self.result: str | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(conv, gbnf, timeout_s))

    def _run(self, conv: GbnfConverter, gbnf: str, timeout_s: float) -> None:
        try:
            self.result = conv.convert(gbnf, timeout_s)
        except BaseException as e:  # noqa: BLE001 - the test asserts on it
            self.error = e

    def __enter__(self) -> ThreadedCall:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(T)
        assert not self._thread.is_alive(), "a conversion outlived its timeout"


def cpu_s(pid: int) -> float:
    """The CPU time `pid` has used, user and system (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_converting(pid: int, idle_cpu_s: float) -> None:
    """Until the child `pid`, idle at `idle_cpu_s` of CPU, has used BUSY_CPU_S more: it has
    a grammar and is converting it."""
    wait_for(lambda: cpu_s(pid) >= idle_cpu_s + BUSY_CPU_S or None)


def wait_for(probe: Callable[[], Any]) -> Any:
    """`probe()`'s first truthy value, polled for at most T."""
    deadline = time.monotonic() + T
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError(f"{probe} never held within {T}s")


def address_space_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max address space"):
            return int(line.split()[3])  # the soft limit, in bytes ("unlimited" fails here)
    raise AssertionError("no address-space limit listed")


def stop(pid: int) -> None:
    """SIGSTOP to `pid`, and wait until every thread of it has stopped: a thread blocked in a
    read is not woken by a signal another thread takes, so it may still run a while."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: all(state(t) == "T" for t in Path(f"/proc/{pid}/task").iterdir()))


def state(task: Path) -> str:
    return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
