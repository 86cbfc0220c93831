"""The client against a stub server: token accounting, and every failure counted by its kind."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from pdserve.bench.config import ArrivalConfig, ClientConfig, Slo
from pdserve.bench.dataset import BenchRequest
from pdserve.bench.record import ErrorKind
from pdserve.bench.runner import RunResult, Workload, run_workloads
from pdserve.bench.stub import Fault, StubServer, Style


@pytest.fixture(scope="module")
def stub() -> Iterator[StubServer]:
    with StubServer(tokens=6) as s:
        yield s


def run(url: str, prompts: list[str], timeout_s: float = 10.0, **arrival: float) -> RunResult:
    client = ClientConfig(url=url, request_timeout_s=timeout_s, connect_timeout_s=timeout_s)
    reqs = [BenchRequest(p, 8, 6) for p in prompts]
    workload = Workload("main", reqs, ArrivalConfig(**arrival))  # type: ignore[arg-type]
    return asyncio.run(run_workloads(client, [workload], Slo(), warmup=0, progress=False))


def test_a_clean_stream_is_counted_token_by_token(stub: StubServer) -> None:
    result = run(stub.url, ["hello"] * 5, max_concurrency=2)
    assert result.model == "stub"  # discovered from /v1/models
    assert [r.ok for r in result.records] == [True] * 5
    for r in result.records:
        assert r.output_tokens == 6 and r.prompt_tokens == 8 and r.finish_reason == "length"
        assert len(r.itl) == 5  # six one-token chunks; the finish chunk is no token
        assert r.ttft is not None and r.latency is not None and r.latency >= r.ttft
    assert sorted(r.index for r in result.records) == list(range(5))
    assert [r.start for r in result.records] == sorted(r.start for r in result.records)
    s = result.summary
    assert (s["completed"], s["failed"], s["output_tokens"]) == (5, 0, 30)


@pytest.mark.parametrize("style", list(Style))
def test_the_finishing_chunk_is_one_token_or_none(stub: StubServer, style: Style) -> None:
    # vLLM's last token rides on the finish chunk; pdserve's finish chunk only flushes text.
    (r,) = run(stub.url, [style.value]).records
    assert (r.ok, r.output_tokens, len(r.itl)) == (True, 6, 5)


def test_every_failure_is_counted_by_kind(stub: StubServer) -> None:
    prompts = [f.value for f in Fault if f is not Fault.STALL] + ["fine"]
    result = run(stub.url, prompts)
    kinds = {prompts[r.index]: r.error for r in result.records}
    assert kinds == {
        Fault.HTTP_503.value: ErrorKind.HTTP,
        Fault.ERROR_EVENT.value: ErrorKind.STREAM_ERROR,
        Fault.TRUNCATED.value: ErrorKind.INCOMPLETE,
        Fault.BAD_JSON.value: ErrorKind.BAD_RESPONSE,
        "fine": None,
    }
    (event,) = [r for r in result.records if prompts[r.index] == Fault.ERROR_EVENT.value]
    assert event.error_detail is not None and "stub failure" in event.error_detail
    assert result.summary["errors"] == {
        "bad_response": 1,
        "http_503": 1,
        "incomplete": 1,
        "stream_error": 1,
    }


def test_a_stalled_server_is_a_timeout(stub: StubServer) -> None:
    result = run(stub.url, [Fault.STALL.value, "fine"], timeout_s=0.5)
    assert result.summary["errors"] == {"timeout": 1}


def test_a_refused_connection_is_a_connection_error() -> None:
    with socket.socket() as s:  # a port that was free a moment ago and has no listener
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run(f"http://127.0.0.1:{port}", ["a", "b"])
    assert result.model is None
    assert result.summary["errors"] == {"connection": 2}
