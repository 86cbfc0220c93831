"""A grammar that is still compiling holds its own request only (engine/grammar_waits.py): the
engine thread never waits on a compile, so every other request decodes meanwhile; once the
grammar is ready the held request's tokens are those of a run that never waited, on a
co-located engine and on D (P's first token held with it); a grammar the engine cannot
compile fails its request alone; a request aborted while held ends and leaks nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.engine.engine import Engine
from pdserve.engine.request import RequestOutput
from pdserve.engine.sampling.grammars import Grammars
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.constraint import ConstraintKind
from tests.engine.test_grammar import SCHEMA, constraint, greedy, mixed_jobs, run
from tests.helpers import make_engine
from tests.worker.wire import Wire

K = ConstraintKind
WAIT_S = 8.0  # below the grammar thread's 10 s deadline: the test opens the gate itself
CONSTRAINED = ("r0", "r2", "r4", "r6")  # mixed_jobs' rows with a grammar
PLAIN = ("r1", "r3", "r5", "r7")


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    ev = threading.Event()
    yield ev
    ev.set()  # never leave the process's grammar thread stuck


def gated(grammars: Grammars, gate: threading.Event) -> None:
    """Each compile of `grammars` waits for `gate` (on the grammar thread, as a slow one)."""
    real = grammars._compiles._matcher

    def slow(kind: ConstraintKind, spec: str):  # type: ignore[no-untyped-def]
        if not gate.wait(WAIT_S):
            raise RuntimeError("the test never opened the gate")
        return real(kind, spec)

    grammars._compiles._matcher = slow  # type: ignore[method-assign]


def submit_all(eng: Engine, jobs) -> tuple[dict[str, list[int]], dict[str, RequestOutput]]:  # type: ignore[no-untyped-def]
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(jobs))}
    ends: dict[str, RequestOutput] = {}
    for i, (prompt, params) in enumerate(jobs):

        def sink(o: RequestOutput, rid: str = f"r{i}") -> None:
            outs[rid].extend(o.token_ids)
            if o.finish_reason is not None:
                ends[rid] = o

        eng.submit(f"r{i}", prompt, params, sink)
    return outs, ends


def tick_until(eng: Engine, done, max_ticks: int = 3000) -> None:  # type: ignore[no-untyped-def]
    for _ in range(max_ticks):
        if done():
            return
        eng.tick()
    raise AssertionError("not done")


def test_a_compiling_grammar_holds_only_its_request(tiny_dir, tok, gate):
    jobs = mixed_jobs(tok, True)
    clean = run(make_engine(tiny_dir), jobs)
    eng = make_engine(tiny_dir)
    gated(eng.grammars, gate)
    outs, ends = submit_all(eng, jobs)
    tick_until(eng, lambda: all(r in ends for r in PLAIN))  # every compile still waits
    for rid in PLAIN:
        assert (outs[rid], ends[rid].finish_reason) == clean[rid], rid
    assert len(eng.grammar_waits) == 4
    assert all(outs[r] == [] and r not in ends for r in CONSTRAINED)
    eng.abort("r0")  # aborted while held: it ends, and is dropped when it settles
    tick_until(eng, lambda: "r0" in ends)
    assert ends["r0"].finish_reason == "abort"
    gate.set()
    tick_until(eng, lambda: len(ends) == len(jobs) and not eng.has_work())
    for rid in CONSTRAINED[1:]:
        assert (outs[rid], ends[rid].finish_reason) == clean[rid], rid
    assert len(eng.grammar_waits) == 0 and eng.pool.allocator.num_held == 0


def test_a_grammar_the_engine_cannot_compile_fails_its_request_alone(tiny_dir, tok):
    """Refused (the spec's fault: remembered) or not compiled (any other error: the server's)."""
    jobs = mixed_jobs(tok, True)
    clean = run(make_engine(tiny_dir), jobs)
    eng = make_engine(tiny_dir)
    real = eng.grammars._compiles._matcher

    def refuse(kind: ConstraintKind, spec: str):  # type: ignore[no-untyped-def]
        if kind is K.REGEX:
            raise ValueError("no token spells it")
        if kind is K.CHOICE:  # not the spec's fault: the server's, still its request's alone
            raise OSError("the tokenizer file went away")
        return real(kind, spec)

    eng.grammars._compiles._matcher = refuse  # type: ignore[method-assign]
    outs, ends = submit_all(eng, jobs)
    tick_until(eng, lambda: len(ends) == len(jobs) and not eng.has_work())
    assert ends["r2"].finish_reason == "error" and outs["r2"] == []
    assert "regex constraint does not compile: no token spells it" in (ends["r2"].error or "")
    assert ends["r4"].finish_reason == "error" and outs["r4"] == []
    assert "choice constraint was not compiled: OSError" in (ends["r4"].error or "")
    for rid in outs:
        if rid not in ("r2", "r4"):
            assert (outs[rid], ends[rid].finish_reason) == clean[rid], rid
    assert eng.metrics.step_errors._value.get() == 0  # refused before any step took it
    assert eng.pool.allocator.num_held == 0


def test_d_holds_p_first_token_until_its_grammar_compiled(tiny_dir, tok, gate):
    c = constraint(K.JSON_SCHEMA, SCHEMA)
    jobs = [
        (tok.encode("json please"), greedy(c)),
        (tok.encode("plain"), greedy(None, max_tokens=8, ignore_eos=True)),
    ]
    colocated = run(make_engine(tiny_dir, page_size=4, chunk=16, overlap=False), jobs)
    wire = Wire(tiny_dir, overlap=False)
    wire.p.grammars.compiled(c)  # P's is ready: only D's compile is slow
    gated(wire.d.grammars, gate)
    outs = {f"r{i}": wire.submit(f"r{i}", p, sp) for i, (p, sp) in enumerate(jobs)}
    # P computes r0's prompt and samples its first token; D adopts it and holds the token.
    wire.run_until(lambda: bool(outs["r1"]) and outs["r1"][-1].finish_reason is not None)
    wire.run_until(lambda: not wire.p_role.by_room)
    r0 = wire.d.scheduler.get("r0")
    assert r0 is not None and r0.grammar_wait and outs["r0"] == [] and r0.output_ids == []
    gate.set()
    wire.run_until(lambda: bool(outs["r0"]) and outs["r0"][-1].finish_reason is not None)
    wire.run_until(wire.idle)
    got = {
        rid: ([t for o in v for t in o.token_ids], v[-1].finish_reason) for rid, v in outs.items()
    }
    assert got == colocated
    assert wire.violations() == []


def test_p_refusing_a_grammar_tells_d_at_once(tiny_dir, tok):
    """P's compile (with the model's vocabulary) may refuse what the front end's check let
    through: D's request fails then, through P's role, not at the room's deadline."""
    c = constraint(K.JSON_SCHEMA, SCHEMA)
    wire = Wire(tiny_dir, overlap=False)

    def refuse(kind: ConstraintKind, spec: str):  # type: ignore[no-untyped-def]
        raise ValueError("P's vocabulary cannot spell it")

    wire.p.grammars._compiles._matcher = refuse  # type: ignore[method-assign]
    outs = wire.submit("r0", tok.encode("json please"), greedy(c))
    wire.run_until(lambda: bool(outs) and outs[-1].finish_reason is not None, max_ticks=200)
    assert outs[-1].finish_reason == "error" and "cannot spell it" in (outs[-1].error or "")
    wire.run_until(wire.idle)
    assert wire.violations() == []


def test_every_request_takes_its_matcher_when_compiled_so_eviction_never_recompiles(tiny_dir, tok):
    """An LRU of one grammar and four distinct ones in flight: each compiled once, since a
    request's matcher is made as its grammar is found compiled, not at its first step."""
    jobs = mixed_jobs(tok, True)
    eng = make_engine(tiny_dir)
    eng.grammars._compiles._cache_size = 1
    run(eng, jobs)
    assert eng.grammars.compiles == 4


def test_a_compile_nobody_polls_again_is_settled_by_the_sweep(tok):
    """A held request that ended (aborted, expired) never polls its grammar again: the tick's
    sweep still settles the compile, so it leaves nothing pending and its thread is free."""
    g = Grammars(lambda: tok, 4096, frozenset())
    assert g.vocab is not None  # built: the poll below starts the grammar's own compile
    assert g.poll(constraint(K.REGEX, "ab+c")) is False
    for _ in range(500):
        g.sweep()
        if not g._compiles._pending:
            break
        threading.Event().wait(0.01)
    assert not g._compiles._pending and g.compiles == 1
