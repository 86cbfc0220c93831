"""The grammar thread (protocol/grammar_thread.py): started lazily with its big stack (the
process-wide default restored), callable from any thread, every wait bounded; a call that runs
past its deadline is CompileTimeout and retires its thread (a fresh one serves the queue), a
call whose turn never came is CompilerBusy and never runs, and past MAX_THREADS nothing new
starts until a retired thread finishes. Constraint and the engine's Grammars turn these into
refusals (InvalidParams, ValueError), remembering only a timeout."""

from __future__ import annotations

import ctypes
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import pdserve.protocol.constraint as constraint_module
from pdserve.protocol.constraint import MAX_GBNF_RULES, Constraint, ConstraintKind, compile_error
from pdserve.protocol.grammar_thread import (
    CompilerBusy,
    CompileTimeout,
    GrammarThread,
    on_grammar_thread,
)
from pdserve.protocol.sampling import InvalidParams

WAIT_S = 5.0  # for a gate the test opens itself


def test_lazy_start_big_stack_and_the_default_restored():
    g = GrammarThread(stack_bytes=64 << 20)
    assert g.threads() == (0, 0)
    before = threading.stack_size()
    name = g.run(lambda: threading.current_thread().name)
    assert name == "grammar-0" and g.threads() == (1, 1)
    assert threading.stack_size() == before
    assert g.run(_own_stack_bytes) >= 64 << 20


def _own_stack_bytes() -> int:
    """This thread's stack size, as glibc reports it (pthread_getattr_np)."""
    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_ulong
    attr = ctypes.create_string_buffer(128)  # a pthread_attr_t (56 bytes on x86-64 glibc)
    assert libc.pthread_getattr_np(ctypes.c_ulong(libc.pthread_self()), attr) == 0
    base, size = ctypes.c_void_p(), ctypes.c_size_t()
    try:
        assert libc.pthread_attr_getstack(attr, ctypes.byref(base), ctypes.byref(size)) == 0
    finally:
        libc.pthread_attr_destroy(attr)
    return size.value


def test_results_and_errors_come_back_from_any_thread():
    g = GrammarThread()
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: g.run(pow, i, 2), range(40)))
    assert got == [i * i for i in range(40)]
    with pytest.raises(ZeroDivisionError):
        g.run(lambda: 1 // 0)
    assert g.run(lambda: g.run(lambda: "inline")) == "inline"  # a call from the thread itself
    assert g.threads() == (1, 1)


def test_a_call_past_its_deadline_retires_its_thread_and_a_fresh_one_serves():
    g = GrammarThread(timeout_s=0.2)
    gate, ran = threading.Event(), threading.Event()

    def stuck() -> None:
        gate.wait(WAIT_S)
        ran.set()

    with pytest.raises(CompileTimeout, match="within 0.2s"):
        g.run(stuck)
    assert g.run(lambda: "next") == "next"  # at once, on a fresh thread
    assert g.threads() == (2, 2)
    gate.set()
    assert ran.wait(WAIT_S)
    _until(lambda: g.threads() == (1, 2))  # the retired thread exits after its call


def test_a_call_whose_turn_never_came_is_busy_and_never_runs():
    g = GrammarThread(timeout_s=0.3)
    gate, started = threading.Event(), threading.Event()
    late_ran = threading.Event()

    def stuck() -> None:
        started.set()
        gate.wait(WAIT_S)

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(g.run, stuck, timeout_s=WAIT_S)
        assert started.wait(WAIT_S)
        with pytest.raises(CompilerBusy, match="did not get to"):
            g.run(late_ran.set)  # queued behind `stuck`, which is within its own deadline
        gate.set()
        first.result(WAIT_S)
    assert g.run(lambda: "after") == "after"
    assert not late_ran.is_set()  # dropped from the queue, not run late


def test_past_max_threads_calls_are_busy_until_a_retired_thread_is_done():
    g = GrammarThread(timeout_s=0.2, max_threads=1)
    gate = threading.Event()
    with pytest.raises(CompileTimeout):
        g.run(gate.wait, WAIT_S)
    with pytest.raises(CompilerBusy, match="busy"):
        g.run(lambda: "no room")
    assert g.threads() == (1, 1)
    gate.set()
    _until(lambda: _runs(g))  # the retired thread serves again
    assert g.threads() == (1, 1)


def test_a_call_taken_late_gets_its_whole_bound_from_when_it_was_taken():
    """Waiting in the queue behind a slow call is not the call's own fault: it is refused
    only if its own run passes the bound (it used to be refused, then cached as broken)."""
    g = GrammarThread(timeout_s=1.0)
    gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(g.run, gate.wait, WAIT_S, timeout_s=0.5)  # retired at 0.5 s
        time.sleep(0.05)
        # Taken at about 0.5 s by the fresh thread, done at about 1.2 s: past 1.0 s from its
        # call, within 1.0 s from when it was taken.
        assert g.run(lambda: (time.sleep(0.7), "quick")[1]) == "quick"
        with pytest.raises(CompileTimeout):
            slow.result(WAIT_S)
    gate.set()


def test_constraint_refuses_a_timeout_remembering_it_and_a_busy_compiler_not(monkeypatch):
    calls: list[str] = []

    def fake(fn, kind, spec, to_lark):
        calls.append(spec)
        raise (CompileTimeout if spec == "slow" else CompilerBusy)("it did not compile")

    monkeypatch.setattr(constraint_module, "on_grammar_thread", fake)
    compile_error.cache_clear()
    for _ in range(2):
        with pytest.raises(InvalidParams, match="regex does not compile") as e:
            Constraint(kind=ConstraintKind.REGEX, spec="slow").check_compiles()
        assert e.value.param == "constraint"
        with pytest.raises(InvalidParams, match="regex was not compiled") as e:
            Constraint(kind=ConstraintKind.REGEX, spec="busy").check_compiles()
        assert e.value.param == "constraint"
    assert calls == ["slow", "busy", "busy"]  # the timeout remembered, busy asked again
    compile_error.cache_clear()


def test_constraints_compile_on_the_grammar_thread(monkeypatch):
    names: list[str] = []

    def spy(fn, *args):
        def named():
            names.append(threading.current_thread().name)
            return fn(*args)

        return on_grammar_thread(named)

    monkeypatch.setattr(constraint_module, "on_grammar_thread", spy)
    compile_error.cache_clear()
    Constraint(kind=ConstraintKind.REGEX, spec="on+the+thread").check_compiles()
    assert len(names) == 1 and names[0].startswith("grammar-")
    compile_error.cache_clear()


def test_a_gbnf_grammar_with_too_many_rules_is_refused_before_converting():
    rules = "".join(f'r{i} ::= "x" r{i + 1}\n' for i in range(MAX_GBNF_RULES))
    spec = f'root ::= r0\n{rules}r{MAX_GBNF_RULES} ::= "x"\n'
    with pytest.raises(InvalidParams, match=f"at most {MAX_GBNF_RULES} rules"):
        Constraint(kind=ConstraintKind.GRAMMAR, spec=spec).check_compiles()
    lark = spec.replace("root ::=", "start:").replace(" ::=", ":")  # Lark has no such bound
    Constraint(kind=ConstraintKind.GRAMMAR, spec=lark).check_compiles()


def _runs(g: GrammarThread) -> bool:
    try:
        return g.run(lambda: True)
    except CompilerBusy:
        return False


def _until(cond, timeout_s: float = WAIT_S) -> None:
    done = threading.Event()
    for _ in range(int(timeout_s / 0.02)):
        if cond():
            return
        done.wait(0.02)
    raise AssertionError("condition not met in time")


def test_a_pending_call_given_up_stays_given_up_when_a_thread_takes_it_late():
    """`ready()` decides: a call past its queue deadline is dropped there and then, so a
    thread that frees up a moment later neither runs it nor turns its outcome into an error
    of another kind."""
    g = GrammarThread(timeout_s=0.2)
    gate = threading.Event()
    first = g.submit(lambda: gate.wait(WAIT_S), timeout_s=WAIT_S)  # holds the thread
    ran: list[str] = []
    late = g.submit(lambda: ran.append("late"), timeout_s=0.2)
    _until(late.ready)
    gate.set()
    assert first.wait() is True
    for _ in range(3):
        with pytest.raises(CompilerBusy):
            late.outcome()
    assert g.run(lambda: "next") == "next" and ran == []


def test_a_submitted_call_is_polled_without_waiting():
    g = GrammarThread()
    gate = threading.Event()
    p = g.submit(lambda: gate.wait(WAIT_S) and "done")
    assert not p.ready()
    with pytest.raises(RuntimeError, match="before it is ready"):
        p.outcome()
    gate.set()
    _until(p.ready)
    assert p.outcome() == "done"
