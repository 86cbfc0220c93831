"""Structured output in the engine (engine/sampling/grammars.py, grammar_mask.py): every
constrained output matches its constraint and ends with "stop" when its grammar is complete,
rows without a grammar get exactly the tokens they get without any grammar in the batch,
the overlapped loop equals the plain one, PD (P's first token, D's matcher continuing it)
equals co-located, and logits wider than the tokenizer are masked past it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine.request import Request, RequestOutput
from pdserve.engine.sampling.grammar_mask import GrammarMask, allowed, apply_grammar_mask
from pdserve.engine.sampling.grammars import Grammars
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.constraint import Constraint, ConstraintKind
from pdserve.protocol.sampling import SamplingParams
from tests.helpers import make_engine
from tests.worker.wire import Wire

K = ConstraintKind
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["ok", "n", "color", "tags"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.com"
CHOICES = ["yes", "no", "maybe"]


def conforms(value: Any, schema: dict[str, Any]) -> bool:
    """The JSON-schema keywords the tests use, checked by hand."""
    if "enum" in schema:
        return value in schema["enum"]
    match schema.get("type"):
        case "object":
            props = schema.get("properties", {})
            return (
                isinstance(value, dict)
                and all(k in value for k in schema.get("required", ()))
                and (schema.get("additionalProperties", True) or set(value) <= set(props))
                and all(conforms(v, props[k]) for k, v in value.items() if k in props)
            )
        case "array":
            return (
                isinstance(value, list)
                and len(value) <= schema.get("maxItems", len(value))
                and all(conforms(v, schema["items"]) for v in value)
            )
        case "integer":
            return (
                isinstance(value, int)
                and not isinstance(value, bool)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value)
            )
        case "boolean":
            return isinstance(value, bool)
        case "string":
            return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    return False


def constraint(kind: ConstraintKind, spec: Any = "") -> Constraint:
    text = spec if isinstance(spec, str) else json.dumps(spec)
    return Constraint(kind=kind, spec=text)


def greedy(c: Constraint | None, **kw: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 60, "temperature": 0, "constraint": c, **kw})


def request(c: Constraint | None) -> Request:
    return Request("r", [1], SamplingParams(constraint=c), sink=lambda o: None)


def one_token(tok: Tokenizer, text: str) -> int:
    [t] = tok.encode(text, add_special_tokens=False)
    return t


def run(eng, jobs) -> dict[str, tuple[list[int], str]]:
    """Submit every (prompt, params) at once, tick until all end: tokens and finish reason."""
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(jobs))}
    ends: dict[str, RequestOutput] = {}
    for i, (prompt, params) in enumerate(jobs):

        def sink(o: RequestOutput, rid: str = f"r{i}") -> None:
            assert rid not in ends
            outs[rid].extend(o.token_ids)
            if o.finish_reason is not None:
                ends[rid] = o

        eng.submit(f"r{i}", prompt, params, sink)
    for _ in range(2000):
        if len(ends) == len(jobs):
            break
        eng.tick()
    assert len(ends) == len(jobs)
    for _ in range(3):
        if eng.has_work():
            eng.tick()
    assert not eng.has_work() and eng.pool.allocator.num_held == 0
    assert eng.metrics.step_errors._value.get() == 0  # no row fell back to sampling alone
    errors = {r: e.error for r, e in ends.items() if e.finish_reason == "error"}
    assert not errors, errors
    return {rid: (outs[rid], ends[rid].finish_reason) for rid in outs}


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


def mixed_jobs(tok: Tokenizer, constrained: bool) -> list[tuple[list[int], SamplingParams]]:
    """Eight rows: four greedy rows without a grammar (one penalised, one drawing) between
    a JSON schema, a regex, a choice and a Lark grammar (greedy and drawn)."""
    kinds = [
        constraint(K.JSON_SCHEMA, SCHEMA),
        constraint(K.REGEX, EMAIL),
        constraint(K.CHOICE, CHOICES),
        constraint(K.GRAMMAR, 'start: "(" sum ")"\nsum: NUM "+" NUM | NUM\nNUM: /[0-9]/'),
    ]
    plain = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0, logprobs=2, ignore_eos=True),
    ]
    jobs = []
    for i in range(4):
        drawn = {"temperature": 0.8, "seed": i} if i % 2 else {}
        params = greedy(kinds[i] if constrained else None, **drawn)
        jobs.append((tok.encode(f"row {i}: " + "word " * i), params))
        jobs.append((tok.encode(f"plain {i} " * (i + 1)), plain[i]))
    return jobs


def check_constrained(tok: Tokenizer, got: dict[str, tuple[list[int], str]]) -> None:
    texts = {rid: tok.decode(ids) for rid, (ids, _) in got.items()}
    assert conforms(json.loads(texts["r0"]), SCHEMA), texts["r0"]
    assert re.fullmatch(EMAIL, texts["r2"]), texts["r2"]
    assert texts["r4"] in CHOICES
    assert re.fullmatch(r"\(\d(\+\d)?\)", texts["r6"]), texts["r6"]
    for rid in ("r0", "r2", "r4", "r6"):  # a complete grammar's end: the EOS it then forces
        assert got[rid][1] == "stop" and got[rid][0][-1] in tok.eos_token_ids, (rid, got[rid])


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_constrained_rows_match_and_plain_rows_are_untouched(tiny_dir, tok, overlap):
    with_grammars = run(make_engine(tiny_dir, overlap=overlap), mixed_jobs(tok, True))
    check_constrained(tok, with_grammars)
    without = run(make_engine(tiny_dir, overlap=overlap), mixed_jobs(tok, False))
    for rid in ("r1", "r3", "r5", "r7"):
        assert with_grammars[rid] == without[rid], rid
    if overlap:  # and the overlapped loop gives the plain loop's tokens
        assert with_grammars == run(make_engine(tiny_dir, overlap=False), mixed_jobs(tok, True))


def test_a_complete_grammar_stops_and_json_object_is_an_object(tiny_dir, tok):
    eng = make_engine(tiny_dir)
    prompt = tok.encode("give me an object")
    jobs = [
        (prompt, greedy(constraint(K.JSON_OBJECT), max_tokens=200)),
        (prompt, greedy(constraint(K.REGEX, "ab"), max_tokens=40)),
        # A grammar that is not done at max_tokens ends by length, its output a prefix.
        (prompt, greedy(constraint(K.REGEX, "x{9}"), max_tokens=3)),
    ]
    got = run(eng, jobs)
    text0 = tok.decode(got["r0"][0])
    if got["r0"][1] == "stop":
        assert isinstance(json.loads(text0), dict)
    else:  # a random model may wander inside a string: still a JSON object's prefix
        assert got["r0"][1] == "length" and text0.startswith("{")
    assert (tok.decode(got["r1"][0]), got["r1"][1]) == ("ab", "stop")
    assert got["r2"][1] == "length" and set(tok.decode(got["r2"][0])) == {"x"}
    assert eng.grammars.compiles == 3  # each constraint compiled once


def test_same_constraint_compiles_once_and_the_cache_is_bounded(tiny_dir, tok):
    g = Grammars(lambda: tok, 4096, frozenset(), cache_size=2)
    a, b, c = (constraint(K.REGEX, r) for r in ("a+", "b+", "c+"))
    assert g.compiled(a) is g.compiled(a) and g.compiles == 1
    g.compiled(b)
    g.compiled(a)  # a is now the most recent: c evicts b
    g.compiled(c)
    assert g.compiled(a) is not None and g.compiles == 3
    g.compiled(b)
    assert g.compiles == 4


def test_a_grammar_that_did_not_compile_is_remembered_a_busy_compiler_not(tok, monkeypatch):
    """The compile runs on the grammar thread; a timeout (the constraint's fault) is refused
    again at once (the isolation's row-by-row retry must not wait for it twice), a compiler
    that never got to it is asked again."""
    import pdserve.engine.sampling.grammar_compiles as grammars_module
    from pdserve.protocol.grammar_thread import (
        CompilerBusy,
        CompileTimeout,
        on_grammar_thread_later,
    )

    calls: list[str] = []

    def timed_out() -> None:
        raise CompileTimeout("it did not compile within 10s")

    def fake(fn, *args, timeout_s=None):
        if not args:  # the vocabulary
            return on_grammar_thread_later(fn, timeout_s=timeout_s)
        kind, spec = args
        calls.append(spec)
        if spec == "slow+":
            return on_grammar_thread_later(timed_out)
        if spec == "busy+" and calls.count(spec) == 1:
            raise CompilerBusy("the grammar compiler is busy")
        return on_grammar_thread_later(fn, kind, spec)

    monkeypatch.setattr(grammars_module, "on_grammar_thread_later", fake)
    g = Grammars(lambda: tok, 4096, frozenset())
    slow, busy = constraint(K.REGEX, "slow+"), constraint(K.REGEX, "busy+")
    for _ in range(2):
        with pytest.raises(ValueError, match="does not compile: it did not compile within"):
            g.compiled(slow)
    with pytest.raises(ValueError, match="was not compiled: the grammar compiler is busy"):
        g.compiled(busy)
    g.sweep()  # the next tick: a busy compiler's refusal is forgotten, a timeout's is not
    assert not g.compiled(busy).is_error()
    assert calls == ["slow+", "busy+", "busy+"] and g.compiles == 1


def test_a_refused_token_raises_and_a_late_matcher_catches_up(tok):
    g = Grammars(lambda: tok, 4096, frozenset())
    params = SamplingParams(constraint=constraint(K.REGEX, "abc"))
    a, b, c, z = (one_token(tok, ch) for ch in "abcz")
    req = Request("r", [1], params, sink=lambda o: None)
    assert g.accept(req, a) is False
    with pytest.raises(ValueError, match=f"token {z} breaks its regex constraint"):
        g.accept(req, z)
    late = Request("late", [1], params, sink=lambda o: None)
    late.output_ids = [a, b]  # emitted before its matcher was made (D adopts with a token)
    assert g.accept(late, c) is False  # caught up, and complete: only an EOS may follow
    mask = g.mask([late], torch.device("cpu"))
    assert mask is not None
    assert allowed(mask.bits, 4096)[0].nonzero().flatten().tolist() == sorted(tok.eos_token_ids)
    assert g.accept(late, min(tok.eos_token_ids)) is True  # the grammar's end: the request's


def test_logits_wider_than_the_tokenizer_are_masked_past_it(tok):
    """A model whose logits are padded past its tokenizer (embedding rows no token has): the
    grammar's vocabulary covers the logits and the padding is never allowed."""
    width = tok.vocab_size + 100
    g = Grammars(lambda: tok, width, frozenset())
    assert g.words * 32 >= width
    anything = constraint(K.REGEX, r"(.|\n)*")
    reqs = [request(anything), request(None), request(anything)]
    logits = torch.zeros(3, width)
    logits[:, tok.vocab_size :] = 50.0  # the padding would win any argmax
    mask = g.mask(reqs, logits.device)
    assert mask is not None and mask.rows.tolist() == [0, 2]
    apply_grammar_mask(logits, mask)
    assert torch.isinf(logits[[0, 2], tok.vocab_size :]).all()
    assert (logits[1, tok.vocab_size :] == 50.0).all()  # the row without a grammar untouched
    assert logits[[0, 2]].argmax(dim=-1).lt(tok.vocab_size).all()
    # and a bitmask wider than the logits is cut to them
    bits = torch.full((1, 4), -1, dtype=torch.int32)
    assert allowed(bits, 100).shape == (1, 100) and allowed(bits, 100).all()
    row = torch.zeros(1, 130)
    apply_grammar_mask(row, GrammarMask(torch.tensor([0]), bits))
    assert torch.isinf(row[0, 128:]).all() and (row[0, :128] == 0).all()


def test_pd_first_token_obeys_and_decode_continues_the_grammar(tiny_dir, tok):
    """P samples the first token under the grammar; D's matcher takes it on adoption and
    the whole output equals the co-located engine's, token for token."""
    jobs = [
        (tok.encode("json please"), greedy(constraint(K.JSON_SCHEMA, SCHEMA))),
        (tok.encode("mail"), greedy(constraint(K.REGEX, EMAIL), temperature=0.7, seed=5)),
        (tok.encode("plain"), greedy(None, max_tokens=8, ignore_eos=True)),
    ]
    colocated = run(make_engine(tiny_dir, page_size=4, chunk=16, overlap=False), jobs)
    for overlap in (False, True):
        wire = Wire(tiny_dir, overlap=overlap)
        assert wire.run_jobs(jobs) == colocated, overlap
        assert wire.violations() == []
    assert conforms(json.loads(tok.decode(colocated["r0"][0])), SCHEMA)
    assert re.fullmatch(EMAIL, tok.decode(colocated["r1"][0]))


def test_a_grammar_that_fails_in_the_engine_fails_its_request_alone(tiny_dir, tok, monkeypatch):
    """A constraint the engine cannot compile (it passed the vocabulary-free check) costs its
    own request: the batch is sampled row by row and every other row keeps its tokens."""
    jobs = mixed_jobs(tok, True)
    clean = run(make_engine(tiny_dir), jobs)
    eng = make_engine(tiny_dir)
    real = eng.grammars.compiled

    def compiled(c: Constraint):
        if c.kind is K.REGEX:
            raise ValueError("the regex constraint does not compile: no such token")
        return real(c)

    monkeypatch.setattr(eng.grammars, "compiled", compiled)
    ends: dict[str, RequestOutput] = {}
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(jobs))}
    for i, (prompt, params) in enumerate(jobs):

        def sink(o: RequestOutput, rid: str = f"r{i}") -> None:
            outs[rid].extend(o.token_ids)
            if o.finish_reason is not None:
                ends[rid] = o

        eng.submit(f"r{i}", prompt, params, sink)
    while len(ends) < len(jobs):
        eng.tick()
    assert ends["r2"].finish_reason == "error" and "no such token" in (ends["r2"].error or "")
    for rid in outs:
        if rid != "r2":
            assert (outs[rid], ends[rid].finish_reason) == clean[rid], rid
