"""The fuzzer in CI (issue 17 part 7, issue 41 item 6): a few hundred seeded hostile requests
against a co-located server (with an API key, so odd Authorization headers meet a key) and a
1P+1D cluster leave no 5xx, no hang, every error an OpenAI body, every valid request served,
the workers quiet and a normal request answering as before. The cases include compressed
bodies (broken, bombs, codings not taken), Authorization headers that are not UTF-8,
timeouts of a microsecond, a prompt of one word of megabytes and connections reset at once."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.chaos import fuzz as fz
from pdserve.chaos import probes
from pdserve.chaos.fuzz_cases import Case, Expect, Send, cases
from pdserve.runtime import httpcall
from tests.procs import LaunchedCluster, ServerProcess, http

API_KEY = "sk-fuzz-0c5a1e7d2b9f"


# The kinds issue 41 item 6 added: each must be among the cases of every CI run below.
WIRE_KINDS = {"encoding", "auth", "tiny_timeout", "huge_word", "reset"}


def test_cases_are_seeded_and_cover_every_kind():
    a = list(cases(3, 2000, "m", 256))
    assert a == list(cases(3, 2000, "m", 256))
    assert [c.body for c in a] != [c.body for c in cases(4, 2000, "m", 256)]
    kinds = Counter(c.kind.split(":")[0] for c in a)
    assert set(kinds) == {
        "valid",
        "field",
        "drop",
        "unknown_field",
        "raw_body",
        "content_type",
        "route",
        *WIRE_KINDS,
    }
    encodings = {c.kind for c in a if c.kind.startswith("encoding:")}
    assert {"encoding:bad_gzip", "encoding:deflate_bomb", "encoding:gzip"} <= encodings
    served = {"encoding:gzip", "encoding:deflate", "encoding:raw_deflate", "encoding:identity"}
    served.add("encoding:gzip_two_members")
    assert all(c.expect is Expect.VALID for c in a if c.kind == "valid" or c.kind in served)
    assert all(c.expect is Expect.ANY for c in a if c.kind != "valid" and c.kind not in served)
    assert all(c.send is Send.RAW for c in a if c.kind == "auth")
    assert all(c.send is Send.RESET for c in a if c.kind == "reset")
    assert all(c.statuses == {200, 408} for c in a if c.kind == "tiny_timeout")


def _case(stream: bool = False, expect: Expect = Expect.VALID) -> Case:
    return Case(0, "t", "POST", "/v1/completions", b"{}", expect, stream)


def _only(*statuses: int) -> Case:
    return Case(0, "t", "POST", "/v1/completions", b"{}", Expect.ANY, statuses=frozenset(statuses))


OPENAI_400 = (
    b'{"error": {"message": "bad", "type": "invalid_request_error", "param": null, "code": null}}'
)


@pytest.mark.parametrize(
    ("case", "status", "body", "wrong"),
    [
        (_case(), 500, b'{"error": {"message": "x"}}', True),
        (_case(expect=Expect.ANY), 400, b'{"error": {"message": "bad n"}}', True),  # no type
        (_case(expect=Expect.ANY), 400, b"Bad Request", True),  # aiohttp's plain text
        (_case(expect=Expect.ANY), 404, b'{"error": {"message": ""}}', True),
        (_case(), 200, b'{"choices": [{"finish_reason": "length"}]}', False),
        (_case(), 200, b'{"choices": [{"finish_reason": "error"}]}', True),
        (_case(expect=Expect.ANY), 200, b'{"choices": [{"finish_reason": "error"}]}', False),
        (_case(stream=True), 200, b'data: {"choices": []}\n\ndata: [DONE]\n\n', False),
        (_case(stream=True), 200, b'data: {"choices": []}\n\n', True),  # no [DONE]
        (_case(stream=True), 200, b'data: {"error": {"message": "x"}}\n\ndata: [DONE]\n\n', True),
        (_case(expect=Expect.ANY), 400, OPENAI_400, False),
        (_only(400), 400, OPENAI_400, False),
        (_only(413), 400, OPENAI_400, True),  # a bomb must be refused for its size
        (_only(200, 408), 503, b'{"error": {"message": "x"}}', True),
    ],
)
def test_check_judges_answers(case, status, body, wrong):
    assert (fz.check(case, status, body) is not None) == wrong


def fuzz_and_check(
    base: str, workers: list[str], seed: int, n: int, headers: dict[str, str] | None = None
) -> fz.FuzzReport:
    before = fz.probe(base)
    assert not isinstance(before, str), before
    model = fz.served_model(base)
    kinds = {c.kind.split(":")[0] for c in cases(seed, n, model, fz.VALID_VOCAB)}
    assert kinds >= WIRE_KINDS, WIRE_KINDS - kinds  # this seed sends every new kind
    report = asyncio.run(fz.fuzz(base, model, fz.VALID_VOCAB, seed, n, headers))
    print(f"fuzz {base} seed {seed}: {report.summary()}")
    assert report.violations == [], json.dumps(report.violations[:20], indent=1)
    assert report.summary()["five_xx"] == 0, report.summary()  # each one is a violation too
    assert report.sent == n and report.valid_ok == report.valid > 0
    assert report.statuses["400"] > 0 and report.statuses["200"] > 0  # both kinds happened
    assert http("GET", base + "/health")[0] == 200
    quiet = probes.wait_quiet(base, workers, 30.0) if workers else None
    assert quiet is None or quiet.ok, quiet
    assert fz.probe(base) == before
    return report


@pytest.fixture(scope="module")
def keyed_server(
    tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    key_file = tmp_path_factory.mktemp("fuzz-key") / "api.key"
    key_file.write_text(API_KEY)
    args = ["serve", "--model", str(tiny_dir), "--served-model-name", "tiny"]
    args += ["--kv-budget-mb", "16", "--max-model-len", "1024", "--api-key-file", str(key_file)]
    with ServerProcess(args, tmp_path_factory.mktemp("fuzz-colo") / "serve.log") as srv:
        yield srv


@pytest.mark.process
def test_fuzz_a_colocated_server(keyed_server, monkeypatch):
    base = keyed_server.url
    bearer = {"Authorization": f"Bearer {API_KEY}"}
    monkeypatch.setattr(httpcall, "_auth", bearer)  # the probes, in this test only
    fuzz_and_check(base, [], seed=1, n=300, headers=bearer)
    inv = http("GET", base + "/debug/invariants")[1]
    assert inv["ok"], inv


@pytest.fixture(scope="module")
def pd_cluster(
    tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LaunchedCluster]:
    args = ["launch", "--model", str(tiny_dir), "--prefill", "1", "--decode", "1"]
    args += ["--threads", "1", "--kv-budget-mb", "16", "--max-model-len", "512", "--port", "0"]
    with LaunchedCluster(args, tmp_path_factory.mktemp("fuzz-pd")) as c:
        yield c


@pytest.mark.process
def test_fuzz_a_pd_cluster(pd_cluster):
    fuzz_and_check(pd_cluster.url, pd_cluster.worker_urls(), seed=2, n=200)
