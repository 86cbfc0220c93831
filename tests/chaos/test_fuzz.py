"""The fuzzer in CI (issue 17 part 7): a few hundred seeded hostile requests against a
co-located server and a 1P+1D cluster leave no 5xx, no hang, every error an OpenAI body,
every valid request served, the workers quiet and a normal request answering as before."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.chaos import fuzz as fz
from pdserve.chaos import probes
from pdserve.chaos.fuzz_cases import Case, Expect, cases
from tests.procs import LaunchedCluster, http


def test_cases_are_seeded_and_cover_every_kind():
    a = list(cases(3, 400, "m", 256))
    assert a == list(cases(3, 400, "m", 256))
    assert [c.body for c in a] != [c.body for c in cases(4, 400, "m", 256)]
    kinds = Counter(c.kind.split(":")[0] for c in a)
    assert set(kinds) == {
        "valid",
        "field",
        "drop",
        "unknown_field",
        "raw_body",
        "content_type",
        "route",
    }
    assert all(c.expect is Expect.VALID for c in a if c.kind == "valid")
    assert all(c.expect is Expect.ANY for c in a if c.kind != "valid")


def _case(stream: bool = False, expect: Expect = Expect.VALID) -> Case:
    return Case(0, "t", "POST", "/v1/completions", b"{}", expect, stream)


@pytest.mark.parametrize(
    ("case", "status", "body", "wrong"),
    [
        (_case(), 500, b'{"error": {"message": "x"}}', True),
        (_case(expect=Expect.ANY), 400, b'{"error": {"message": "bad n"}}', False),
        (_case(expect=Expect.ANY), 400, b"Bad Request", True),  # aiohttp's plain text
        (_case(expect=Expect.ANY), 404, b'{"error": {"message": ""}}', True),
        (_case(), 200, b'{"choices": [{"finish_reason": "length"}]}', False),
        (_case(), 200, b'{"choices": [{"finish_reason": "error"}]}', True),
        (_case(expect=Expect.ANY), 200, b'{"choices": [{"finish_reason": "error"}]}', False),
        (_case(stream=True), 200, b'data: {"choices": []}\n\ndata: [DONE]\n\n', False),
        (_case(stream=True), 200, b'data: {"choices": []}\n\n', True),  # no [DONE]
        (_case(stream=True), 200, b'data: {"error": {"message": "x"}}\n\ndata: [DONE]\n\n', True),
    ],
)
def test_check_judges_answers(case, status, body, wrong):
    assert (fz.check(case, status, body) is not None) == wrong


def fuzz_and_check(base: str, workers: list[str], seed: int, n: int) -> fz.FuzzReport:
    before = fz.probe(base)
    assert not isinstance(before, str), before
    report = asyncio.run(fz.fuzz(base, fz.served_model(base), fz.VALID_VOCAB, seed, n))
    assert report.violations == [], json.dumps(report.violations[:20], indent=1)
    assert report.sent == n and report.valid_ok == report.valid > 0
    assert report.statuses["400"] > 0 and report.statuses["200"] > 0  # both kinds happened
    assert http("GET", base + "/health")[0] == 200
    quiet = probes.wait_quiet(base, workers, 30.0) if workers else None
    assert quiet is None or quiet.ok, quiet
    assert fz.probe(base) == before
    return report


def test_fuzz_a_colocated_server(tiny_server):
    base = tiny_server.url
    fuzz_and_check(base, [], seed=1, n=300)
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


def test_fuzz_a_pd_cluster(pd_cluster):
    fuzz_and_check(pd_cluster.url, pd_cluster.worker_urls(), seed=2, n=200)
