"""Constraint: what a request's output must match (structured output), as one typed wire form.

A constraint is a `kind` and a `spec`, the spec always text so that the struct is hashable
and one (kind, spec) pair names one compiled grammar in the engine's cache
(engine/sampling/grammars.py):

    JSON_SCHEMA  a JSON schema, as JSON text (the client's key order kept: it is the order
                 the properties are generated in)
    JSON_OBJECT  any JSON object; spec ""
    REGEX        a regular expression the whole output matches
    CHOICE       one of a list of strings, the list as JSON text
    GRAMMAR      a context-free grammar: Lark (llguidance's dialect) or GBNF (llama.cpp's)

The grammar engine is llguidance (its compiler runs without a tokenizer here, and with the
model's vocabulary in the engine). `grammar_source` turns a constraint into llguidance's
grammar text, the one translation both sides use. A GBNF grammar is first converted to Lark by
the `to_lark` its caller passes: llguidance's converter is pure Python and holds the GIL for
seconds on a large grammar, so the serving sides (the front end, D's /generate, the engine)
pass runtime/gbnf_converter.py's, which converts in a child process; `convert_here`, the
default, runs it on the calling thread (tools, tests). Nothing here starts a process.

Building or decoding a Constraint checks only what costs nothing (its kind, its text, its
size), so any thread may decode one: P's control thread, an engine process's pipe, an event
loop. Whether it compiles is a separate check, `check_compiles`, once per distinct constraint
(an LRU cache), made by the sides that face a client: the front end (which renames the field
to the one the client sent) and D's /generate, each on its constraint threads
(frontend/constraint_threads.py), so a schema, regex or grammar that cannot compile is a 400
there. The engine compiles its own matcher without waiting (engine/sampling/grammars.py) and
fails the request alone if that fails.

Every compile, here and in the engine, runs on the grammar thread (protocol/grammar_thread.py):
llguidance recurses once per rule or `$ref`, and a long chain within MAX_CONSTRAINT_BYTES would
overflow an ordinary thread's stack and kill the process. One that takes longer than
COMPILE_TIMEOUT_S is refused as not compiling (and remembered so); a compiler too busy to
start it is refused without being remembered. `check_compiles` waits for its compile: a few
milliseconds for a usual spec, up to COMPILE_TIMEOUT_S for a hostile one (twice that behind a
busy compiler). A GBNF conversion runs within CONVERSION_SHARE of its compile's bound, so its
outcome comes before the compile's deadline: a conversion that ran past it is the grammar's
cost (refused and remembered), one the converter could not run (its turn or its start did not
come, or it died) is "busy". A GBNF grammar of more than MAX_GBNF_RULES rules is refused before
llguidance's converter, whose time grows with the square of a rule chain. A `oneOf` is
compiled as `anyOf` (llguidance's `coerce_one_of`, as xgrammar does): an output matching more
than one branch is allowed.

JSON is generated without free whitespace (", " and ": " between items), so a small model
cannot spend its tokens on blank lines; a schema's own "x-guidance" options override that.

Sans-I/O and torch-free: the router imports this module.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from functools import lru_cache

import llguidance
import msgspec
from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

from pdserve.protocol.grammar_thread import (
    GRAMMAR_THREAD,
    CompilerBusy,
    CompileTimeout,
    on_grammar_thread,
)
from pdserve.protocol.invalid_params import InvalidParams, show

# A constraint's spec in UTF-8 bytes: it travels in every PrefillRequest, whose allowance for
# everything but the prompt is 1 MiB (transfer/control_limits.py PEER_MESSAGE_ALLOWANCE).
MAX_CONSTRAINT_BYTES = 128 * 1024
# Distinct constraints whose compile check is remembered (a process checks the same one on
# every hop and for every choice of n).
CHECK_CACHE_SIZE = 64
MAX_ERROR_CHARS = 500  # of llguidance's message, which may quote the whole grammar
# GBNF rules converted to Lark (llguidance's Python converter takes ~1 s for 2,000 chained
# rules, ~20 s for the 9,000 a 128 KiB spec can hold); "::=" counted, so a literal holding it
# counts too.
MAX_GBNF_RULES = 2000
CONVERSION_SHARE = 0.75  # of a compile's bound, for its GBNF conversion (see conversion_bound)
JSON_OPTIONS: llguidance._lib.JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "coerce_one_of": True,
}
# A GBNF grammar's Lark text within a bound in seconds: ValueError (its message) if it does not
# convert, TimeoutError if the conversion ran past the bound (the grammar's cost), OSError if
# it could not be converted for the server's trouble.
ToLark = Callable[[str, float], str]


def convert_here(gbnf: str, timeout_s: float) -> str:
    """A ToLark: llguidance's converter on the calling thread, holding the GIL throughout;
    `timeout_s` is not enforced (a grammar thread's deadline is)."""
    try:
        return gbnf_to_lark(gbnf)
    except Exception as e:  # noqa: BLE001 - it raises anything on bad text (as llguidance.grammar_from catches)
        raise ValueError(str(e) or type(e).__name__) from None


class ConstraintKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


class Constraint(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    kind: ConstraintKind
    spec: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ConstraintKind):
            kinds = ", ".join(k.value for k in ConstraintKind)
            raise InvalidParams(
                f"constraint kind must be one of {kinds}, got {show(self.kind)}", "constraint"
            )
        if not isinstance(self.spec, str):
            raise InvalidParams(
                f"constraint spec must be a string, got {show(self.spec)}", "constraint"
            )
        try:
            size = len(self.spec.encode())
        except UnicodeEncodeError:  # a lone surrogate
            raise InvalidParams("constraint spec is not valid text", "constraint") from None
        if size > MAX_CONSTRAINT_BYTES:
            raise InvalidParams(
                f"constraint spec is {size} bytes; at most {MAX_CONSTRAINT_BYTES} are accepted",
                "constraint",
            )

    def check_compiles(self, to_lark: ToLark = convert_here) -> None:
        """InvalidParams naming `constraint` unless it compiles (remembered per process): the
        check of a side facing a client, which blocks up to COMPILE_TIMEOUT_S (twice that
        behind a busy compiler), so never on an event loop. `to_lark` converts a GBNF
        grammar."""
        try:
            error = compile_error(self.kind, self.spec, to_lark)
        except CompilerBusy as e:  # not the spec's fault, so not remembered
            raise InvalidParams(f"{self.kind.value} was not compiled: {e}", "constraint") from None
        if error is not None:
            raise InvalidParams(f"{self.kind.value} does not compile: {error}", "constraint")

    @classmethod
    def from_builtins(cls, d: object) -> Constraint:
        """The wire form back; InvalidParams naming `constraint` on anything wrong."""
        try:
            return msgspec.convert(d, cls)
        except msgspec.ValidationError as e:
            if isinstance(e.__cause__, InvalidParams):
                raise e.__cause__ from None
            raise InvalidParams(f"bad constraint: {e}", "constraint") from None


def grammar_source(kind: ConstraintKind, spec: str, to_lark: ToLark = convert_here) -> str:
    """llguidance's grammar text for a constraint; ValueError if it cannot be built (bad JSON,
    a GBNF grammar that does not convert), CompileTimeout if `to_lark` ran past the grammar
    thread's bound, CompilerBusy if it could not convert. Whether it compiles is
    `compile_error`'s."""
    match kind:
        case ConstraintKind.JSON_SCHEMA:
            schema = json.loads(spec)
            if schema is True:  # the schema every value matches
                spec = "{}"
            elif not isinstance(schema, dict):
                raise ValueError(f"a JSON schema is an object or true, got {show(schema)}")
            return llguidance.LLMatcher.grammar_from_json_schema(spec, JSON_OPTIONS)
        case ConstraintKind.JSON_OBJECT:
            if spec:
                raise ValueError("a json_object constraint has no spec")
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
        case ConstraintKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(spec)
        case ConstraintKind.CHOICE:
            choices = json.loads(spec)
            if not (
                isinstance(choices, list)
                and choices
                and all(isinstance(c, str) and c for c in choices)
            ):
                raise ValueError("choices must be a non-empty list of non-empty strings")
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices)
            )
        case ConstraintKind.GRAMMAR:
            if is_lark_syntax(spec):
                return llguidance.LLMatcher.grammar_from_lark(spec)
            if spec.count("::=") > MAX_GBNF_RULES:
                raise ValueError(f"a GBNF grammar may have at most {MAX_GBNF_RULES} rules")
            return llguidance.LLMatcher.grammar_from_lark(_converted(spec, to_lark))
    raise ValueError(f"unknown constraint kind {kind!r}")


def conversion_bound() -> float:
    """A GBNF conversion's bound: CONVERSION_SHARE of its compile's (the grammar thread's), so
    that a converter given up on is killed and its outcome (busy, or too costly) raised on the
    grammar thread before the compile's own deadline passes, with time to compile after it."""
    return GRAMMAR_THREAD.timeout_s * CONVERSION_SHARE


def _converted(gbnf: str, to_lark: ToLark) -> str:
    try:
        return to_lark(gbnf, conversion_bound())
    except ValueError as e:
        raise ValueError(f"the GBNF grammar does not convert to Lark: {e}") from None
    except TimeoutError as e:
        raise CompileTimeout(str(e)) from None
    except OSError as e:
        raise CompilerBusy(f"the GBNF grammar was not converted ({e}); try again") from None


@lru_cache(maxsize=CHECK_CACHE_SIZE)
def compile_error(kind: ConstraintKind, spec: str, to_lark: ToLark = convert_here) -> str | None:
    """Why the constraint cannot compile (llguidance's message, or that its own run took too
    long: time queued behind others is not counted), or None if it can. Runs on the grammar
    thread; CompilerBusy if that never got to it (or `to_lark` could not convert)."""
    try:
        return on_grammar_thread(_compile_error, kind, spec, to_lark)
    except CompileTimeout as e:
        return str(e)


def _compile_error(kind: ConstraintKind, spec: str, to_lark: ToLark) -> str | None:
    try:
        source = grammar_source(kind, spec, to_lark)
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        return str(e)[:MAX_ERROR_CHARS]
    except RecursionError:  # JSON nested past Python's recursion limit
        return "it nests too deeply"
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, None)
    return "; ".join(messages)[:MAX_ERROR_CHARS] if is_error else None
