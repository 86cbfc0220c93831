"""Structured output through real processes: the router's OpenAI API over one prefill and one
decode worker (`pdserve launch --prefill 1 --decode 1`) and a co-located server. P samples the
first token under the grammar, D's matcher continues from it: the answers match their
constraints and equal the co-located server's token for token; a schema that cannot compile
is a 400 naming the field, at the router as at the worker."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.engine.test_grammar import EMAIL, SCHEMA, conforms
from tests.procs import LaunchedCluster, http

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


@pytest.fixture(scope="module")
def pd_cluster(
    tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LaunchedCluster]:
    flags = ["--model", str(tiny_dir), "--served-model-name", "tiny", "--kv-budget-mb", "16"]
    # shm on a CPU; a pool on a GPU is not in shared host memory, so tcp there.
    backend = "tcp" if torch.cuda.is_available() else "shm"
    flags += ["--max-model-len", "1024", "--threads", "1", "--backend", backend]
    with LaunchedCluster(
        ["launch", "--prefill", "1", "--decode", "1", *flags],
        tmp_path_factory.mktemp("structured-pd"),
    ) as c:
        yield c


def ask(url: str, path: str, body: dict) -> tuple[int, dict]:
    base = {"model": "tiny", "max_tokens": 60, "temperature": 0}
    return http("POST", url + path, {**base, **body})


CHAT = [{"role": "user", "content": "a small JSON object please"}]
CASES = [
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
            },
            "logprobs": True,
        },
    ),
    ("/v1/completions", {"prompt": "mail: ", "guided_regex": EMAIL, "seed": 3, "temperature": 0.8}),
    ("/v1/completions", {"prompt": "pick", "structured_outputs": {"choice": ["left", "right"]}}),
]


def answer(path: str, resp: dict) -> tuple[str, list[int] | None]:
    choice = resp["choices"][0]
    if path.endswith("chat/completions"):
        lp = choice["logprobs"]["content"]
        return choice["message"]["content"], [len(e["token"]) for e in lp]
    return choice["text"], None


def test_pd_obeys_the_grammar_and_equals_colocated(pd_cluster, tiny_server):
    for path, body in CASES:
        status, pd = ask(pd_cluster.url, path, body)
        assert status == 200, pd
        status, co = ask(tiny_server.url, path, body)
        assert status == 200, co
        assert answer(path, pd) == answer(path, co), path
        assert pd["choices"][0]["finish_reason"] == "stop"
    _, json_answer = ask(pd_cluster.url, *CASES[0])
    assert conforms(json.loads(json_answer["choices"][0]["message"]["content"]), SCHEMA)
    _, mail = ask(pd_cluster.url, *CASES[1])
    assert re.fullmatch(EMAIL, mail["choices"][0]["text"])
    _, pick = ask(pd_cluster.url, *CASES[2])
    assert pick["choices"][0]["text"] in ("left", "right")


@pytest.mark.parametrize("which", ["pd", "colocated"])
def test_a_schema_that_cannot_compile_is_a_400_naming_the_field(pd_cluster, tiny_server, which):
    url = pd_cluster.url if which == "pd" else tiny_server.url
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    status, body = ask(url, "/v1/chat/completions", {"messages": CHAT, "response_format": bad})
    assert status == 400, body
    assert body["error"]["param"] == "response_format.json_schema.schema"
    assert "Invalid type: objectx" in body["error"]["message"]
    two = {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}
    status, body = ask(url, "/v1/completions", two)
    assert status == 400 and body["error"]["param"] == "guided_choice", body


NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "where": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "floor": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "where"],
    "additionalProperties": False,
}


def test_fifty_json_schema_answers_validate_colocated_and_in_pd(pd_cluster, tiny_server):
    """Issue 45's target: 50 of 50 json_schema answers validate against their schema, through
    the router over P and D as through the co-located server, and the two agree (seeded)."""
    from concurrent.futures import ThreadPoolExecutor

    bodies = []
    for i in range(50):
        schema = (SCHEMA, NESTED)[i % 2]
        bodies.append(
            {
                "messages": [{"role": "user", "content": f"record {i}: give it as JSON"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": f"s{i % 2}", "schema": schema, "strict": True},
                },
                "max_tokens": 120,
                "temperature": 0.9,
                "seed": i,
            }
        )

    def run(url: str) -> list[dict]:
        def one(body: dict) -> dict:
            status, resp = ask(url, "/v1/chat/completions", body)
            assert status == 200, resp
            return resp["choices"][0]

        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(one, bodies))

    pd, co = run(pd_cluster.url), run(tiny_server.url)
    for i, (p, c) in enumerate(zip(pd, co, strict=True)):
        schema = (SCHEMA, NESTED)[i % 2]
        assert p["finish_reason"] == "stop", (i, p)
        assert conforms(json.loads(p["message"]["content"]), schema), (i, p)
        assert p["message"]["content"] == c["message"]["content"], i
