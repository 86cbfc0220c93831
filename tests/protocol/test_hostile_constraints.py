"""Constraints that recurse deep in llguidance's compiler (protocol/grammar_thread.py): a Lark
rule chain and a JSON-schema `$ref` chain, each as long as MAX_CONSTRAINT_BYTES allows, either
compile or are refused with InvalidParams on every path that checks a constraint (the front
end's fields, SamplingParams off the wire as D's /generate checks them, the engine's matcher),
called from a thread with an ordinary 8 MiB stack, and the process lives.

Each runs in a subprocess, so an overflow (SIGSEGV) fails the test instead of killing pytest;
the control shows the same input kills a process that calls llguidance on such a thread."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.protocol.hostile_specs import lark_chain, longest, ref_chain

pytestmark = pytest.mark.process  # each case runs in a subprocess
ROOT = Path(__file__).resolve().parents[2]
SPECS = {"lark": ("grammar", lark_chain), "ref": ("json_schema", ref_chain)}

# Runs `path` for the spec on stdin from an 8 MiB thread; prints the outcome, exit 0.
SCRIPT = textwrap.dedent(
    """
    import json, sys, threading
    path, kind, tiny = sys.argv[1], sys.argv[2], sys.argv[3]
    spec = sys.stdin.read()

    def direct():  # the control: llguidance on this thread, as no pdserve path calls it
        import llguidance
        from pdserve.protocol.constraint import ConstraintKind, grammar_source
        source = grammar_source(ConstraintKind(kind), spec)
        return llguidance.LLMatcher.validate_grammar_with_warnings(source, None)[0]

    def constraint():
        from pdserve.protocol.constraint import Constraint, ConstraintKind
        c = Constraint(kind=ConstraintKind(kind), spec=spec)
        c.check_compiles()
        return c.kind

    def wire():  # D's /generate: SamplingParams off the wire, then the compile check
        from pdserve.protocol.sampling import SamplingParams
        c = {"kind": kind, "spec": spec}
        params = SamplingParams.from_builtins({"max_tokens": 2, "constraint": c})
        params.constraint.check_compiles()
        return params.constraint.kind

    def fields():  # the front end: each field that carries this kind
        from pdserve.frontend.structured import build_constraint, find_constraint
        from pdserve.protocol.constraint import compile_error
        if kind == "grammar":
            bodies = [{"guided_grammar": spec}, {"structured_outputs": {"grammar": spec}}]
        else:
            schema = {"name": "n", "schema": json.loads(spec)}
            bodies = [
                {"guided_json": spec},
                {"response_format": {"type": "json_schema", "json_schema": schema}},
            ]
        for body in bodies:
            compile_error.cache_clear()  # each compiles afresh
            build_constraint(find_constraint(body))
        return len(bodies)

    def engine():  # the engine thread building the request's matcher
        import pdserve.protocol.constraint as pc
        from pdserve.engine.sampling.grammars import Grammars
        from pdserve.model.tokenizer import Tokenizer
        from pdserve.protocol.constraint import Constraint, ConstraintKind
        pc.compile_error = lambda kind, spec, to_lark=None: None  # the engine's compile alone
        tok = Tokenizer.from_dir(tiny)
        c = Constraint(kind=ConstraintKind(kind), spec=spec)
        return Grammars(lambda: tok, tok.vocab_size, frozenset()).compiled(c).is_error()

    out = {}
    def call():
        from pdserve.protocol.invalid_params import InvalidParams
        try:
            out["ok"] = repr(globals()[path]())
        except (InvalidParams, ValueError) as e:
            out["refused"] = str(e)[:200]

    threading.stack_size(8 << 20)  # an ordinary thread's stack, whatever `ulimit -s` says
    t = threading.Thread(target=call)
    t.start()
    t.join(120)
    print(json.dumps(out), flush=True)
    """
)


def run(path: str, name: str, tiny: Path | str = "") -> subprocess.CompletedProcess[str]:
    kind, build = SPECS[name]
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, path, kind, str(tiny)],
        input=longest(build),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=180,
    )


def outcome(p: subprocess.CompletedProcess[str]) -> dict[str, str]:
    assert p.returncode == 0, f"exit {p.returncode}: {p.stderr[-2000:]}"
    out: dict[str, str] = json.loads(p.stdout.splitlines()[-1])
    assert out, p.stderr[-2000:]  # it answered within the thread's join
    return out


@pytest.mark.parametrize("name", SPECS)
def test_control_llguidance_on_an_ordinary_thread_overflows(name):
    """Without the grammar thread the process dies: these inputs are hostile, so the tests
    below can fail. If llguidance stops recursing per rule, find an input that still does."""
    p = run("direct", name)
    assert p.returncode == -signal.SIGSEGV, (p.returncode, p.stdout, p.stderr[-500:])


@pytest.mark.parametrize("path", ["constraint", "wire", "fields"])
@pytest.mark.parametrize("name", SPECS)
def test_a_long_chain_compiles_or_is_refused_and_the_process_lives(path, name):
    out = outcome(run(path, name))  # the process lived (a refusal would be InvalidParams)
    assert "ok" in out, out  # and, the grammar thread's stack being enough, it compiled


@pytest.mark.parametrize("name", SPECS)
def test_the_engine_builds_the_matcher_of_a_long_chain(name, tiny_dir):
    assert outcome(run("engine", name, tiny_dir)) == {"ok": "False"}
